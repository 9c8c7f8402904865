# Character-level tiny Shakespeare: the quick start. On a 2-core CPU it passes val loss 1.88 in about 50 s
# and ends near 1.66 after about 2 minutes; on a GPU it is done in seconds.
# python train.py configs/shakespeare.py, then python sample.py --out_dir=out-shakespeare
#
# Tuned for time-to-quality on 2 CPU cores (fp32); what was measured is in the README's Performance section.
# From nanoGPT's CPU recipe (lr 1e-3, gelu, 2000 iters: val 1.92 here): a 3x learning rate reaches a given loss in
# about 40% fewer steps (5e-3 is no better), ReLU runs 4% faster than GELU at the same loss, batch 32 gives 15% more
# tokens/s but needs more tokens for the same loss, wider or deeper models lose more speed than they gain in
# quality within 2 minutes, torch.compile costs 19 s of compilation for no speed-up at this size, and rope is
# 13% slower here than learned positions.
out_dir = "out-shakespeare"
dataset = "shakespeare_char"
eval_interval = 250
eval_iters = 20
log_interval = 100
always_save_checkpoint = False  # best.pt keeps the best; ckpt.pt is written at the end

batch_size = 12
block_size = 64
gradient_accumulation_steps = 1

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
activation = "relu"

learning_rate = 3e-3
max_iters = 3300
lr_decay_iters = 3300
min_lr = 3e-4
warmup_iters = 50
beta2 = 0.99  # small batches: a longer second-moment average
weight_decay = 0.1
