# GPT-2 (124M) from scratch on OpenWebText, on 8 GPUs: torchrun --standalone --nproc_per_node=8 train.py configs/gpt2.py
# For FineWeb-Edu: --dataset=fineweb_edu. Prepare the data first (python prepare_data.py openwebtext): it takes hours.
out_dir = "out-gpt2"
dataset = "openwebtext"

# 12 sequences x 1024 tokens x 40 micro-batches = 491,520 tokens (~0.5M) per step; the 40 split as 5 per GPU on 8 GPUs
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

learning_rate = 6e-4
max_iters = 600000  # 300B tokens
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1
beta2 = 0.95

eval_interval = 1000
eval_iters = 200  # shared out over the ranks: 25 batches each on 8 GPUs
log_interval = 10
