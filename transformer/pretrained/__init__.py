"""Models trained elsewhere, read into this project's model: Marian (OPUS-MT) checkpoints in the Hugging Face format
(marian.py)."""
