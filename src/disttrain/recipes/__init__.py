"""Ready-made tasks for common jobs, built on the Trainer like any TrainTask (docs/finetune.md).

- causal_lm.py    fine-tune a pretrained causal language model from a local directory: LoRA or full
- text_data.py    the text, read and tokenized once, cut into fixed windows
- load_once.py    the pretrained weights read by one rank and sent to the others
- host_memory.py  how much host memory a piece of code really takes
- hf_save.py      the fine-tuned model saved as a Hugging Face directory
"""
