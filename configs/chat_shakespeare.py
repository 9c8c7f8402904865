# Chat fine-tuning on a laptop CPU: the quick-start model (configs/shakespeare.py, out-shakespeare/best.pt) learns to
# answer a quiz on tiny Shakespeare (shakespeare_chat, generated offline: who speaks a line, word counts, sums in
# words) in the built-in chat template, whose four markers join its 65 characters as new embedding rows.
#   python train.py configs/shakespeare.py              # first, if out-shakespeare/best.pt is not there yet
#   python train.py configs/chat_shakespeare.py         # then talk to it:
#   python sample.py --out_dir=out-chat-shakespeare --chat
# Each evaluation reports the exact match of its greedy replies on held-out questions; iteration 0 is the quick-start
# model before any fine-tuning. Measured numbers in docs/chat.md.
out_dir = "out-chat-shakespeare"
dataset = "shakespeare_chat"
init_from = "out-shakespeare/best.pt"
eval_interval = 250
eval_iters = 20
eval_accuracy_examples = 200
log_interval = 100
always_save_checkpoint = False  # best.pt keeps the best val loss (on the assistant's tokens)

# the model's settings (2 layers, 128 wide, block_size 64) come from the checkpoint
batch_size = 32
gradient_accumulation_steps = 1
dropout = 0.0

learning_rate = 2e-3
max_minutes = 3.0  # the schedule follows the time used; --max_minutes=0 --max_iters=N for a step-exact run
max_iters = 100000  # only a cap
warmup_iters = 50
min_lr = 2e-4
beta2 = 0.99
weight_decay = 0.1
