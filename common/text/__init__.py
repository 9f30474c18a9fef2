"""What the text recipe alone uses: documents from folders and tables, split by their content,
as token ids in batches by length (data)."""
