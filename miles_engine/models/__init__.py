"""What a model is, for everyone above it (engines, trainer, tito, checkpoints): a model
reference and its forms (:mod:`.source`: HF directory, ``.gguf``, ``package:``, ``tiny:``,
config-only), loading one (:mod:`.loading`, torch), its tokenizer (:mod:`.tokenizer`), the one
BPE trainer and the built-in tokenizers (:mod:`.bpe`), a tiny policy's cached BPE
(:mod:`.policy_tokenizer`) and the tiny model (:mod:`.tiny`). Importing this package is cheap."""
