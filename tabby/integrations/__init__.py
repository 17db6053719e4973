"""Tabby inside training frameworks: ``tabby.integrations.transformers`` (the experts backend of
HuggingFace transformers 5.x). Each module imports its framework only when used."""
