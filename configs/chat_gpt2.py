# Chat fine-tuning of GPT-2 (124M) on your own conversations: a JSONL file of {"messages": [{"role", "content"}]}
# lines in the built-in chat template, whose four markers take GPT-2's free ids 50257-50260.
#   python train.py configs/chat_gpt2.py --data_options="{'input': 'conversations.jsonl'}" --init_from=/path/to/gpt2
# init_from: a Hugging Face GPT-2 folder (or the hub id "gpt2" when online), a nanoGPT ckpt.pt, or one of ours
# trained on GPT-2 BPE. The data is prepared on the first run (python prepare_data.py chat --help for the options).
out_dir = "out-chat-gpt2"
dataset = "chat"
data_options = {"tokenizer": "gpt2", "block_size": 1024, "name": "chat_gpt2"}  # written to data/chat_gpt2
init_from = "gpt2"
eval_interval = 50
eval_iters = 20
log_interval = 10
always_save_checkpoint = False  # fine-tuning overfits quickly: best.pt keeps the best val loss

# whole conversations per micro-batch, padded to the longest of each batch (of about one length)
batch_size = 8
gradient_accumulation_steps = 8
block_size = 1024
dropout = 0.1

learning_rate = 3e-5
decay_lr = False
max_iters = 300
