"""Text in and out: tokenizers, incremental detokenization with stop strings, chat templates."""
