# The 2017 paper's base Transformer, translating English to French (opus_books through Hugging Face datasets,
# GPT-2 BPE). Offline: --data_options="{'input': 'pairs.tsv'}" with source<TAB>target lines. One GPU.
out_dir = "out-translation"
arch = "encoder_decoder"
dataset = "translation"
data_options = {"src": "en", "tgt": "fr"}
eval_interval = 1000
eval_iters = 50
eval_accuracy_examples = 100  # exact match is a harsh measure for translation; the val loss is the main one
log_interval = 50

batch_size = 64
block_size = 128  # longer pairs are left out (the count is logged)
gradient_accumulation_steps = 1

# the paper's base model: 6 + 6 layers, 512 wide, 8 heads, 2048 MLP, post-norm, ReLU, sinusoidal positions
n_layer = 6
n_encoder_layer = 6
n_head = 8
n_embd = 512
d_ff = 2048
dropout = 0.1
bias = True
norm_position = "post"
activation = "relu"
pos_encoding = "sinusoidal"
share_embeddings = True
label_smoothing = 0.1

lr_schedule = "noam"
warmup_iters = 4000
learning_rate = 7e-4  # 512**-0.5 * 4000**-0.5: the paper's peak
beta2 = 0.98
weight_decay = 0.0
max_iters = 100000
