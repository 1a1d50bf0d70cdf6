"""Pretrained policies: one model source for engine and trainer (:mod:`.source`), the chat
family from the model (:mod:`.family`, the ``template`` family), LoRA (:mod:`.lora`) and
``miles export`` (:mod:`.export`). Importing this package is cheap."""
