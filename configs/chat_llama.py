# LoRA chat fine-tuning of a Llama, Mistral or Qwen folder (Llama-3.2-1B-Instruct, Qwen2.5-0.5B-Instruct, ...) on
# your conversations, in the folder's own chat template (tokenizer_config.json or chat_template.jinja). The base
# stays frozen: only rank-16 adapters on every attention and MLP matrix train, and checkpoints hold just those.
#   python train.py configs/chat_llama.py --init_from=/models/Llama-3.2-1B-Instruct \
#       --data_options="{'input': 'conversations.jsonl', 'tokenizer': '/models/Llama-3.2-1B-Instruct'}"
#   python sample.py --out_dir=out-chat-llama --chat --system="You are a helpful assistant."
#   python export.py --out_dir=out-chat-llama --dest=llama-chat     # the adapters merged into plain weights
out_dir = "out-chat-llama"
dataset = "chat"
data_options = {"block_size": 2048, "name": "chat_llama"}  # written to data/chat_llama
eval_interval = 50
eval_iters = 20
log_interval = 10
always_save_checkpoint = False

batch_size = 4
gradient_accumulation_steps = 8
block_size = 2048

lora_rank = 16
lora_alpha = 32.0
lora_dropout = 0.05
lora_targets = "attention,mlp"

learning_rate = 2e-4  # adapters take a larger learning rate than whole weights
warmup_iters = 20
min_lr = 2e-5
max_iters = 500
weight_decay = 0.0
