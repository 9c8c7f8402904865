# Fine-tune GPT-2 (124M) on tiny Shakespeare in GPT-2 BPE. Needs the weights: online, or a local Hugging Face
# folder (--init_from=/path/to/gpt2). Larger models: --init_from=gpt2-medium, gpt2-large or gpt2-xl.
out_dir = "out-shakespeare-finetune"
dataset = "shakespeare"
init_from = "gpt2"
eval_interval = 5
eval_iters = 40
log_interval = 1
always_save_checkpoint = False  # fine-tuning overfits quickly: best.pt keeps the best val loss

# 32 sequences of 1024 tokens per step; the model's own settings (12 layers, 768 wide, ...) come from GPT-2
batch_size = 1
gradient_accumulation_steps = 32
block_size = 1024
dropout = 0.1

learning_rate = 3e-5  # fine-tuning: a small, constant learning rate
decay_lr = False
max_iters = 20
