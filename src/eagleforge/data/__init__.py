"""Data: conversations, chat templates and loss masks, the draft vocab map, datasets."""
