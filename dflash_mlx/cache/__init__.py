"""The prompt cache: states kept after prompts and answers, in memory and on disk, restored for
requests that begin alike."""
