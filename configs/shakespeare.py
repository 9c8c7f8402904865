# Character-level tiny Shakespeare: the quick start. A good result in a couple of minutes on a 2-core CPU.
# python train.py configs/shakespeare.py, then python sample.py --out_dir=out-shakespeare
out_dir = "out-shakespeare"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 20
log_interval = 50
always_save_checkpoint = False  # best.pt keeps the best; ckpt.pt is written at the end

batch_size = 12
block_size = 64
gradient_accumulation_steps = 1

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99  # small batches: a longer second-moment average
weight_decay = 0.1
