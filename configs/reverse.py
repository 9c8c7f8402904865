# The original encoder-decoder Transformer on a synthetic task: reverse a string of up to 12 digits and letters.
# Offline data (generated); exact-match accuracy on val pairs is logged at each evaluation.
out_dir = "out-reverse"
arch = "encoder_decoder"
dataset = "reverse"  # or "sort", "num2words" (raise block_size to 64 for its longer targets)
eval_interval = 250
eval_iters = 20
eval_accuracy_examples = 200
log_interval = 50
always_save_checkpoint = False

batch_size = 64
block_size = 16  # sources of up to 12 characters; targets need one more position for eos
gradient_accumulation_steps = 1

# the 2017 paper's choices, scaled down: fixed sinusoidal positions, ReLU, one shared vocabulary
n_layer = 3
n_head = 4
n_embd = 128
dropout = 0.1
pos_encoding = "sinusoidal"
activation = "relu"
share_embeddings = True
label_smoothing = 0.1

lr_schedule = "noam"  # warmup, then 1/sqrt(step)
learning_rate = 2e-3  # the peak, reached at warmup_iters
warmup_iters = 200
max_iters = 2000
beta2 = 0.98
weight_decay = 0.0
