"""The text recipe's variants, each built from recipes/text.py (its Config, settle(), the model,
make_optimizer, make_scheduler, train_one_epoch and evaluate): a
repetition counts real tokens (not padding), the same in every variant for whole epochs."""

import dataclasses
import sys
import time

import numpy as np
import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from bench_tools import load_recipe, recipe_config
from common.progress import Progress
from common.schedule import fit_schedule


class ClassicDocuments(Dataset):
    """What the classic loop reads: a document's token ids (cut at max_length) and its label."""

    def __init__(self, token_set):
        self.set = token_set

    def __len__(self):
        return len(self.set)

    def __getitem__(self, i):
        start, n = self.set.starts[i], self.set.lengths[i]
        return torch.from_numpy(
            self.set.tokens[start : start + n].astype(np.int64)
        ), self.set.labels[i]


def pad_collate(samples):
    """The classic loop's batch: every document padded with 0 to the batch's longest."""
    tokens = torch.nn.utils.rnn.pad_sequence([t for t, _ in samples], batch_first=True)
    return tokens, torch.stack([y for _, y in samples])


def batch_tokens(batches, lengths):
    """(real, padded) tokens of batches of document indices, each padded to its longest."""
    real = sum(int(lengths[b].sum()) for b in batches)
    return real, sum(len(b) * int(lengths[b].max()) for b in batches)


# What a user would run instead (linear_baselines): TF-IDF of word 1-2 grams, or of character
# 1-4 grams within words (as for short texts and language identification), and a linear model.
BASELINES = {  # name: (the line's words, TfidfVectorizer's n-grams, the model)
    "tfidf_linear_svm": ("TF-IDF word 1-2 grams + linear SVM", {"ngram_range": (1, 2)}, "svm"),
    "tfidf_logistic": ("TF-IDF word 1-2 grams + logistic", {"ngram_range": (1, 2)}, "logistic"),
    "tfidf_chars_linear_svm": (
        "TF-IDF char 1-4 grams in words + linear SVM",
        {"analyzer": "char_wb", "ngram_range": (1, 4)},
        "svm",
    ),
}


def linear_baselines(text, cfg):
    """What a user would run instead (BASELINES): TF-IDF (sublinear counts, n-grams of 2
    documents at least) and a linear SVM or a logistic regression (scikit-learn, at their
    defaults), on the recipe's own split (its list_documents), each document cut at max_length
    bytes as the recipe cuts its bytes. Each one's test accuracy, and the seconds it took to fit
    on the training split and label the test split."""
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.svm import LinearSVC
    except ModuleNotFoundError:
        raise SystemExit(
            "error: the TF-IDF baselines need scikit-learn: pip install -r requirements-extras.txt"
        ) from None
    train, test, _, _ = text.list_documents(cfg)
    cut = slice(cfg.max_length or None)
    found = {}
    for name, (_, grams, model) in BASELINES.items():
        start = time.perf_counter()
        vectorizer = TfidfVectorizer(min_df=2, sublinear_tf=True, **grams)
        model = LinearSVC() if model == "svm" else LogisticRegression()
        features = vectorizer.fit_transform([t[cut].decode("latin-1") for t in train.texts])
        model.fit(features, train.labels)
        predicted = model.predict(
            vectorizer.transform([t[cut].decode("latin-1") for t in test.texts])
        )
        seconds = time.perf_counter() - start
        accuracy = float(np.mean(predicted == np.asarray(test.labels)))
        found[name] = {"accuracy": accuracy, "seconds": round(seconds, 2)}
    return found


def bench_text(args, accelerator):
    """Set up the text variants, as bench_mnist does; rep() returns the real tokens it trained.
    info["after_rounds"](results): each variant's test accuracy after its repetitions (the same
    epochs for all: the same budget) and its share of padding."""
    text = load_recipe("text")
    device = accelerator.device
    cfg = recipe_config(text, args)
    cfg, data, train_loader, test_loader = text.settle(cfg, accelerator)  # as main() settles it
    train_set, lengths = data.train_set, data.train_set.lengths
    epoch_steps = len(train_loader)
    steps = args.steps or epoch_steps
    if steps > epoch_steps:
        raise SystemExit(f"error: --steps {steps} is more than one epoch ({epoch_steps} steps)")
    lr = cfg.scaled_lr(accelerator.num_processes)
    settings = text.model_settings(cfg)
    models, padding = {}, {}

    def new_model(name):
        set_seed(cfg.seed)  # the same initial weights in every variant
        model = text.build_model(settings, len(data.classes), data.tokenizer)
        optimizer = text.make_optimizer(model, cfg, lr=lr, accelerator=accelerator)
        model, optimizer = accelerator.prepare(model, optimizer)
        models[name] = model
        return model, optimizer

    def cosine(optimizer):
        """The recipe's schedule over the bench's epochs of `steps` steps each (fit_cosine)."""
        scheduler = text.make_scheduler(optimizer, cfg)
        scheduler.T_max = max(cfg.epochs * steps, 1)
        return scheduler

    def step(model, optimizer, scheduler, x, y):
        """The recipe's training step with nothing around it."""
        loss = text.loss_of(cfg.model)(model(x), y)
        accelerator.backward(loss)
        if cfg.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def setup_recipe():
        model, optimizer = new_model("recipe")
        scheduler = text.make_scheduler(optimizer, cfg)
        progress = Progress(accelerator, cfg, metric="accuracy")
        fit_schedule(scheduler, cfg, progress, batches_per_epoch=epoch_steps)
        sampler = train_loader.batch_sampler  # its batches of document indices, set_epoch's
        skip = epoch_steps - steps

        def rep():
            train_loader.set_epoch(progress.epoch)
            if skip:  # where a checkpoint taken `skip` batches into this epoch resumes
                progress.load({**progress.state(), "batches_done": skip})
            loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            train = text.train_one_epoch(
                model,
                loader,
                optimizer,
                scheduler=scheduler,
                accelerator=accelerator,
                cfg=cfg,
                progress=progress,
                ema=None,
                data=data,
            )
            if progress.interrupted:
                raise KeyboardInterrupt
            if not progress.end_epoch(epoch_steps):
                raise RuntimeError(f"the epoch ended after {progress.batches_done} batches")
            padding["recipe"] = train["padding"]
            rep.peak_mb = train["peak_memory_mb"]
            return batch_tokens(list(sampler)[skip:], lengths)[0]

        return rep

    def setup_bound():
        model, optimizer = new_model("bound")
        scheduler = cosine(optimizer)
        train_loader.set_epoch(1)
        batches = [(x.to(device), y.to(device)) for x, y in list(train_loader)[:steps]]
        real = sum(int((x != 0).sum()) for x, _ in batches)
        padding["bound"] = 1 - real / sum(x.numel() for x, _ in batches)

        def rep():
            model.train()
            for x, y in batches:
                step(model, optimizer, scheduler, x, y)
            return real

        return rep

    def setup_classic():
        model, optimizer = new_model("classic")
        scheduler = cosine(optimizer)
        loader = DataLoader(
            ClassicDocuments(train_set),
            batch_size=cfg.batch_size,
            shuffle=True,
            collate_fn=pad_collate,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        counted = {"real": 0, "padded": 0}

        def rep():
            model.train()
            real = 0
            for i, (x, y) in enumerate(loader):
                if i == steps:
                    break
                x, y = x.to(device), y.to(device)
                step(model, optimizer, scheduler, x, y)
                real += int((x != 0).sum())
                counted["padded"] += x.numel()
            counted["real"] += real
            padding["classic"] = 1 - counted["real"] / counted["padded"]
            return real

        return rep

    def after_rounds(results):
        """Each variant's test accuracy (the recipe's evaluate()) and padding share."""
        figures = {}
        for name, model in models.items():
            result = text.evaluate(model, test_loader, accelerator, text.loss_of(cfg.model))
            accuracy = result["accuracy"]
            tokens = results[name]["median_samples_per_s"]
            figures[name] = {"accuracy": accuracy, "padding": round(padding[name], 4)}
            figures[name]["real_tokens_per_s_median"] = tokens
        ratio = (
            figures["recipe"]["real_tokens_per_s_median"]
            / results["classic"]["median_samples_per_s"]
        )
        notes = [
            f"{name}: test accuracy {f['accuracy']:.4f} after {cfg.epochs} epochs, padding "
            f"{f['padding']:.1%}"
            for name, f in figures.items()
        ]
        notes.append(f"recipe/classic real tokens per second: {ratio:.2f}x (ratio of medians)")
        baselines = linear_baselines(text, cfg)  # the same split, the same text of each document
        for name, (words, _, _) in BASELINES.items():
            notes.append(
                f"{words}: test accuracy {baselines[name]['accuracy']:.4f}, "
                f"{baselines[name]['seconds']:.1f} s to fit and label"
            )
        report = {"per_variant": figures, "recipe_over_classic_tokens": round(ratio, 3)}
        return {**report, **baselines}, notes

    train_loader.set_epoch(1)
    real, padded = batch_tokens(list(train_loader.batch_sampler)[epoch_steps - steps :], lengths)
    info = {
        "dataset": cfg.dataset,
        "config": args.config,
        "settings": dataclasses.asdict(cfg),  # as main() resolves them (text.resolved)
        "unit": "real tokens",
        "train_samples": len(train_set),
        "batch_size": cfg.batch_size,
        "max_batch_tokens": cfg.max_batch_tokens,
        "steps_per_rep": steps,
        "samples_per_rep": real,  # real tokens: the recipe's in epoch 1 (others: about as many)
        "model": f"{cfg.model} (width {cfg.width}, depth {cfg.depth}) on {cfg.tokenizer}",
        "optimizer": f"AdamW(lr={lr:g}, weight_decay={cfg.weight_decay}), gradient norm clipped "
        f"to {cfg.grad_clip}, scheduler {cfg.scheduler} over {cfg.epochs} epochs of {steps} "
        f"steps, in every variant (recipes/text.py make_optimizer and make_scheduler)",
        "recipe_loop": "recipes/text.py load_data + make_loaders (GlobalBucketSampler) + "
        "train_one_epoch",
        "recipe_padding_epoch1": round(1 - real / padded, 4),  # of the batches it measures
        "startup_cmd": [
            sys.executable,
            "recipes/text.py",
            "--dataset",
            cfg.dataset,
            *(["--config", args.config] if args.config else []),
            "--smoke",
            "--smoke_steps",
            "1",
        ],
        "startup_marker": "text: ",  # main() prints this line after data, model and prepare()
        "what": {
            "recipe": "recipe's batches by length + train_one_epoch",
            "bound": "the recipe's batches of epoch 1, already on the device",
            "classic": f"shuffled batches of {cfg.batch_size}, padded to their longest",
        },
        "after_rounds": after_rounds,
    }
    variants = {"recipe": setup_recipe, "bound": setup_bound, "classic": setup_classic}
    return info, variants
