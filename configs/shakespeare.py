# Character-level tiny Shakespeare: the quick start, two minutes of training whatever the machine (max_minutes),
# the learning rate decaying with the clock.
# python train.py configs/shakespeare.py, then python sample.py --out_dir=out-shakespeare
# --max_minutes=0 --max_iters=3300: the step-exact run, the same on every machine.
#
# Tuned for time-to-quality on 2 CPU cores (fp32), from nanoGPT's CPU recipe (4 layers, lr 1e-3, GELU): 2 layers,
# lr 5e-3, ReLU, a moving average of the weights, AdamW beta1 0.8 and two key/value heads. What each choice gained,
# and what was tried without gain (the modern recipe's other changes included), is in docs/performance.md.
out_dir = "out-shakespeare"
dataset = "shakespeare_char"
eval_interval = 150  # often enough to see the run pass 1.88 within a few seconds
eval_iters = 20
log_interval = 250
always_save_checkpoint = False  # best.pt keeps the best; ckpt.pt is written at the end

batch_size = 12
block_size = 64
gradient_accumulation_steps = 1

n_layer = 2
n_head = 4
n_kv_head = 2  # grouped-query attention: two key/value heads, each read by two query heads
n_embd = 128
dropout = 0.0
activation = "relu"

learning_rate = 5e-3
max_minutes = 2.0  # the schedule follows the time used; --max_minutes=0 for a run that repeats exactly
max_iters = 100000  # only a cap: on a fast GPU the 2 minutes hold more steps than that
min_lr = 5e-4
warmup_iters = 50
beta1 = 0.8  # a shorter momentum: lower val loss per step, at no cost in time
beta2 = 0.99  # small batches: a longer second-moment average
weight_decay = 0.1
ema_decay = 0.99  # evaluate, save and sample the average of about the last 100 steps' weights
