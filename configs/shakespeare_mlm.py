# A masked language model (BERT-style encoder) on character-level tiny Shakespeare, on a CPU in a few minutes.
# sample.py --out_dir=out-shakespeare-mlm fills in masked characters.
out_dir = "out-shakespeare-mlm"
arch = "encoder"
dataset = "shakespeare_char"
mask_prob = 0.15  # 80% of these shown as [MASK], 10% as a random character, 10% unchanged
eval_interval = 250
eval_iters = 20
log_interval = 50
always_save_checkpoint = False

batch_size = 32
block_size = 64
gradient_accumulation_steps = 1

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99
