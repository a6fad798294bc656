"""Data: shared data set loaders, prompt templates, the character tokenizer and the synthetic task."""
