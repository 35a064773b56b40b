"""The target model: a Llama-family decoder in paddle, its loaders and its tokenizer."""
