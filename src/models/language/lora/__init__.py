"""LoRA adapters on a frozen QwenLM (`adapter=lora`), built with peft's injection API.

`adapter.py` is the adapter a LanguageModel holds (src/utils/contracts.py `Adapter`);
`spec.py` its config values, `injection.py` the adapter layers in the network (and folding
them in), `base.py` how checkpoints name the base instead of holding it, `peft_folder.py`
the folder that peft loads.
"""
