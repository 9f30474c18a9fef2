"""Document classifier: documents of any length, batched by length, on any number of processes.

    make data/spam && python recipes/text.py                     # one process, ham against spam
    accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/text.py --dataset DIR
    python recipes/text.py --predict "mail/*.txt" --weights runs/text/model.safetensors

The accelerate config picks CPU, GPUs and fp16/bf16. Settings: the Config fields below and
common.config's RunConfig, by `--config run.yaml` and `--field value`. This file trains;
predict, export and the data check are text_predict.py's, which runs in this file's place when
given --predict, --export or --check_data (it imports this file, never the other way). Copy
these files to start your own
recipe; `# ADAPT:` marks what to change: here, in text_data.py (the data) and text_model.py
(the model and its input).
"""

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np
import torch
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR
from tqdm.auto import tqdm

from common.accelerator import (
    accelerator_for,
    close,
    describe,
    from_main_process,
    fused_kernels,
)
from common.checkpoint import (
    fit_to_record,
    load_weights,
    read_record,
    record_metadata,
    resume_or_start,
    save_best,
    save_final,
    save_training,
)
from common.config import RunConfig, UserError, require, require_at_least
from common.data import DataError
from common.determinism import set_deterministic
from common.ema import EMA
from common.evaluation import ExactSums, evaluation_model
from common.metrics import peak_memory_mb, reset_peak_memory
from common.outputs import open_run, write_csv
from common.progress import Progress
from common.runtime import hand_over, run
from common.signals import catch_stop_signals
from common.text.data import (
    TokenCount,
    TokenSet,
    check_splits,
    cut_note,
    test_loader_by_length,
    train_loader_by_length,
)
from common.tracking import start_logging
from text_data import list_documents  # ADAPT: your data
from text_model import (  # ADAPT: your model
    MODEL_SETTINGS,
    PAD_MULTIPLE,
    Bag,
    LazyAdamW,
    Tokenizer,
    build_model,
    check_model_settings,
    describe_model,
    encoder_config,
    learning_rate,
    loss_of,
)

NAME = Path(__file__).stem  # a copy gets its own name in checkpoints, trackers and output_dir
SERVING = Path(__file__).with_name(f"{NAME}_predict.py")  # predict, export, the data check


@dataclass
class Config(RunConfig):
    # Data. ADAPT: folders train/<class>/ and test/<class>/ of documents (any file names, read
    # as bytes), one folder per class, or tables that datasets.load_dataset reads.
    dataset: str = "data/spam"  # `make data/spam` writes it: SpamAssassin's ham and spam
    text_column: str = "text"  # tables: the documents (text, or binary: bytes as they are)
    label_column: str = "label"  # tables: the classes (a ClassLabel, ints 0.., or names)
    train_split: str = "train"  # a folder or a table split
    test_split: str = "test"  # none such: val_fraction of the training split is held out
    val_fraction: float = 0.2  # the share held out, by a hash of each document's content
    output_dir: str = f"runs/{NAME}"  # config.yaml, metrics.jsonl, weights, checkpoints/
    # Input and model (text_model.py); the weights file records them, predict rebuilds them.
    model: str = "bag"  # bag: word n-grams; cnn: ByteCNN; transformer; pretrained (docs/text.md)
    tokenizer: str = "auto"  # auto: words (bag) or bytes; chars: words, their 2-4 byte grams; bpe
    vocab_size: int = 0  # words: n-grams at most (0: 1,000,000); bpe: subwords (0: 8,000)
    max_length: int = 8192  # of each document its first bytes (tokens, for bpe); 0: whole
    pretrained: str = ""  # model pretrained: a Hugging Face encoder, hub name or folder
    width: int = 64  # channels (cnn) or model dimension (transformer: 32 x k); not the bag's
    depth: int = 2  # convolutions (cnn) or encoder layers (transformer)
    dropout: float = 0.1  # cnn and transformer
    # Batches: documents of similar lengths, padded to the batch's longest. global_batch_size:
    # the same optimizer steps on 1 process or 8 (each takes its share, batch_size at most, and
    # accumulates the rest), so a second GPU trains the same steps in about half the time.
    global_batch_size: int = 32  # documents per optimizer step; 0: batch_size per process
    max_batch_tokens: int = 0  # global_batch_size 0: tokens a batch (0: batch_size x max_length)
    # Training.
    epochs: int = 5
    batch_size: int = 32  # documents per process batch, at most
    eval_batch_size: int = 64  # documents per process batch in evaluation, at most
    lr: float = 0.0  # AdamW learning rate; 0: the model's (bag 3e-2, cnn and transformer 2e-3)
    weight_decay: float = 0.01  # AdamW weight decay
    scheduler: str = "cosine"  # cosine: to 0 at the last step; constant
    grad_clip: float = 1.0  # clip the gradient norm to this; 0: no clipping
    seed: int = 0  # model init and data order; same seed, same run
    num_workers: int = 0  # DataLoader workers per process; the documents are in memory already
    # Predict, export and the data check: text_predict.py, with settings of its own, which a
    # config.yaml of an earlier run may still hold (top_k, predict_csv); training skips them.
    SERVING_SETTINGS: ClassVar[dict] = dict.fromkeys(("top_k", "predict_csv"), SERVING.name)
    predict: str | None = None  # documents (a glob) to label with --weights, by text_predict.py

    def validate(self):
        super().validate()
        require_at_least(self, 0, "weight_decay", "grad_clip", "max_batch_tokens")
        require(
            0 < self.val_fraction < 1, f"val_fraction must be in (0, 1), got {self.val_fraction}"
        )
        require(
            self.scheduler in ("cosine", "constant"),
            f"scheduler must be cosine or constant, got {self.scheduler!r}",
        )
        require(
            self.global_batch_size or self.batch_size >= 2,
            "batch_size must be at least 2: the epoch's last step may give a process two documents",
        )
        require(
            not (self.global_batch_size and self.max_batch_tokens),
            "global_batch_size counts documents, max_batch_tokens tokens: set one (with "
            "--global_batch_size 0, batches of batch_size documents per process at most)",
        )
        check_model_settings(self)  # text_model.py


# The weights file's record: what predict and export need besides the weights.
RECORD = "text"


def read_trained(path):
    """What a weights file of this recipe records (model settings, classes, tokenizer), or None
    (no --weights, or a file that records none, such as a state_dict .pt)."""
    return read_record(path, RECORD) if path else None


def model_settings(cfg):
    return {k: getattr(cfg, k) for k in MODEL_SETTINGS}


@dataclass
class TextData:
    """What load_data() makes: the splits as token ids, the class names, the tokenizer, and the
    start-up notes."""

    train_set: TokenSet
    test_set: TokenSet
    classes: list
    tokenizer: Tokenizer
    notes: list


def load_data(cfg, accelerator, trained=None, checkpoint=None):
    """The documents of --dataset (text_data.py), checked, as token ids: every process reads them
    all (bad data stops all alike). trained: the record of --weights, whose classes the data
    must have; the tokenizer: make_tokenizer()'s."""
    train, test, classes, notes = list_documents(cfg)
    if trained and trained["classes"] != classes:
        raise DataError(
            f"{cfg.weights} was trained on the classes {', '.join(trained['classes'])}; "
            f"{cfg.dataset} has {', '.join(classes)}: train on data with the same classes"
        )
    notes = notes + check_splits(train, test, classes)
    tokenizer = make_tokenizer(cfg, accelerator, train, len(classes), trained, checkpoint)
    tokens, lengths = tokenizer.encode_training(train.texts)
    notes.insert(0, cut_note(lengths, cfg.max_length, tokenizer.cut_unit()))
    train_set = TokenSet(tokens, train.labels, train.names, PAD_MULTIPLE)
    test_set = TokenSet(tokenizer.encode(test.texts), test.labels, test.names, PAD_MULTIPLE)
    if cfg.overfit_batches:  # can the model learn a few batches? Trained and evaluated on alike
        drawn = np.random.default_rng(cfg.seed).permutation(len(train_set))
        train_set = test_set = train_set.subset(
            drawn[: cfg.overfit_samples(accelerator.num_processes)]
        )
    return TextData(train_set, test_set, classes, tokenizer, notes)


def make_tokenizer(cfg, accelerator, train, num_classes, trained=None, checkpoint=None):
    """The tokenizer of the weights file (`trained`: its record), or of the checkpoint that the
    run resumes from, whose trainer_state.json holds it: the same subwords, always. Else a new
    one: bytes, or words or bpe made from the training documents `train` on the main process,
    and sent to the others (training on each could break ties differently)."""
    if trained:
        return Tokenizer.from_record(trained["tokenizer"], cfg.max_length)
    state = Path(checkpoint or "") / "trainer_state.json"
    if checkpoint and state.is_file():  # else resume_training says what is wrong with it
        record = json.loads(state.read_text())["tokenizer_record"]
        return Tokenizer.from_record(record, cfg.max_length)
    settings = model_settings(cfg)
    record = from_main_process(
        accelerator,
        lambda: Tokenizer.trained(settings, train.texts, train.labels, num_classes).record(),
    )
    return Tokenizer.from_record(record, cfg.max_length)


def resolved(cfg, data):
    """cfg with what the data decides, as main() trains and scripts/bench.py measures it:
    max_batch_tokens 0 is batch_size x max_length (or x the longest training document); with
    global_batch_size it stays 0 (batches count documents). A document that two of would not
    fit a batch stops here."""
    if cfg.global_batch_size:
        return cfg
    longest = int(data.train_set.sizes().max())  # padded as in a batch
    budget = cfg.max_batch_tokens or cfg.batch_size * (cfg.max_length or longest)
    if budget < 2 * longest:
        i = int(data.train_set.lengths.argmax())
        raise UserError(
            f"max_batch_tokens {budget:,} does not hold two of the longest training document, "
            f"{data.train_set.names[i]} ({data.train_set.lengths[i]:,} {data.tokenizer.unit()}, "
            f"{longest:,} padded): raise it to {2 * longest:,}, or cut the documents with "
            f"--max_length"
        )
    return replace(cfg, max_batch_tokens=budget)


def settle(cfg, accelerator, checkpoint=None):
    """(cfg, data, train_loader, test_loader): the settings this run trains with, settled here
    once, and the data they read: this process count's share of global_batch_size (batch_size and
    accumulation steps); the model settings of --weights (its record); a constant lr for
    overfit_batches; the documents as token ids (load_data); max_batch_tokens (resolved); then
    the loaders by length (make_loaders). checkpoint: the one the run resumes from, whose
    tokenizer it keeps."""
    cfg = cfg.split_global_batch(accelerator.num_processes)
    trained = read_trained(cfg.weights)  # --weights: its model settings, classes, tokenizer
    if trained:
        cfg = fit_to_record(cfg, trained["model"], MODEL_SETTINGS, path=cfg.weights, inferred=())
    cfg = replace(cfg, lr=learning_rate(cfg))  # lr 0: the model's
    if cfg.overfit_batches:  # the first batches as they are, at a constant lr
        cfg = replace(cfg, scheduler="constant")
    data = load_data(cfg, accelerator, trained, checkpoint)
    cfg = resolved(cfg, data)
    return cfg, data, *make_loaders(cfg, data, accelerator)


def make_loaders(cfg, data, accelerator):
    """The loaders by length, sharded and on the device already (do not prepare() them)."""
    train_loader = train_loader_by_length(
        data.train_set,
        accelerator=accelerator,
        max_batch_tokens=cfg.max_batch_tokens,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        global_batch=cfg.global_batch_size,
        num_workers=cfg.num_workers,
    )
    longest = max(int(data.train_set.sizes().max()), int(data.test_set.sizes().max()))
    test_loader = test_loader_by_length(
        data.test_set,
        accelerator=accelerator,
        max_batch_tokens=cfg.eval_batch_size * (cfg.max_length or longest),
        batch_size=cfg.eval_batch_size,
        num_workers=cfg.num_workers,
    )
    return train_loader, test_loader


def batches_line(cfg):
    """What a training batch is, for the start-up line."""
    if cfg.global_batch_size:
        return cfg.batch_size
    return (
        f"batches of at most {cfg.batch_size} documents and {cfg.max_batch_tokens:,} padded tokens "
        f"per process, formed by length for all processes together, then split"
    )


def make_optimizer(model, cfg, *, lr, accelerator):
    """AdamW with fused kernels where they work: one update for all the weights (fused_kernels).
    The bag: LazyAdamW, which moves an n-gram's weights only in the steps that see it."""
    if isinstance(model, Bag):
        return LazyAdamW(model.parameter_groups(), lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=fused_kernels(accelerator)
    )


def make_scheduler(optimizer, cfg):
    """cosine: to 0 at the run's last optimizer step (its T_max is set by fit_schedule, also on a
    resume); constant: the lr throughout."""
    if cfg.scheduler == "cosine":
        return CosineAnnealingLR(optimizer, T_max=1)
    return LambdaLR(optimizer, lambda step: 1.0)


# The settings that fix each process's batches: a mid-epoch checkpoint resumes only with these.
DATA_ORDER = (
    "dataset",
    "train_split",
    "val_fraction",
    "seed",
    "batch_size",
    "gradient_accumulation_steps",
    "global_batch_size",
    "max_batch_tokens",
    "max_length",
    "tokenizer",
    "vocab_size",
    "overfit_batches",
)


def save(accelerator, cfg, *, progress, scheduler, data):
    """A checkpoint: Accelerate's state, the position in the data, the LR schedule, DATA_ORDER,
    and what a resume needs the same: the class names and the tokenizer."""
    save_training(
        accelerator,
        cfg,
        progress=progress,
        scheduler=scheduler,
        recipe=NAME,
        data_order=DATA_ORDER,
        **same_data(data),
    )


def same_data(data):
    """What a checkpoint records of the data, which a resume must find the same."""
    return {"classes": data.classes, "tokenizer_record": data.tokenizer.record()}


def train_one_epoch(model, loader, optimizer, *, scheduler, accelerator, cfg, progress, ema, data):
    """One pass over this process's batches, or their rest after a resume. `progress` counts the
    batches and steps, says when to log, checkpoint and stop, and sums up the epoch; `tokens`
    counts the real and padded tokens (train_tokens_per_s, padding)."""
    model.train()
    progress.start_epoch(len(loader))
    tokens = TokenCount(accelerator)
    main_process = accelerator.is_main_process
    loss_fn = loss_of(cfg.model)  # ADAPT: your loss (text_model.py)
    for x, y in tqdm(loader, f"epoch {progress.epoch}", disable=not main_process, leave=False):
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(progress.weighted(loss))  # a short last group weighs more
            if cfg.grad_clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad()
        tokens.update(x)
        if not progress.after_batch(loss, len(y)):  # still accumulating
            continue
        # Stepped here, once per optimizer step: a prepared scheduler steps once per process.
        if not accelerator.optimizer_step_was_skipped:
            scheduler.step()
        if ema is not None:  # the moving average of the weights, once per optimizer step
            ema.update()
        if progress.log_due:
            accelerator.log(progress.train_scalars(optimizer), step=progress.step)
        if progress.checkpoint_due:  # every checkpoint_every_steps, and before stopping
            save(accelerator, cfg, progress=progress, scheduler=scheduler, data=data)
        if progress.stopping:  # max_steps, or Ctrl-C / SIGTERM on any rank
            break
    return {**progress.epoch_metrics(), **tokens.compute()}


@torch.inference_mode()
def evaluate(model, loader, accelerator, loss_fn):
    """Accuracy and loss (loss_fn's, the model's loss_of()) over the test split, every document
    counted once on any number of processes. Its batches by length repeat nothing, so the
    processes may hold different numbers of them: no process waits on another per batch
    (common/evaluation.py)."""
    net = evaluation_model(model, accelerator, bucketed=True)
    sums = ExactSums(accelerator, bucketed=True)
    for x, y in loader:
        logits = net(x).float()
        loss = loss_fn(logits, y, reduction="none")  # ADAPT: your metric
        loss, correct = sums.each_sample(loss, logits.argmax(1) == y)
        sums.add(loss=loss, correct=correct)
    totals = sums.totals()
    return {
        "accuracy": totals["correct"] / totals["samples"],
        "eval_loss": totals["loss"] / totals["samples"],
        "eval_samples": totals["samples"],
    }


def evaluate_with_average(model, ema, loader, accelerator, loss_fn):
    """evaluate() of the model, and with ema (ema_decay) of the weights' moving average too, as
    ema_accuracy, ema_eval_loss, ..."""
    result = evaluate(model, loader, accelerator, loss_fn)
    if ema is not None:
        averaged = evaluate(ema.synced(accelerator), loader, accelerator, loss_fn)
        result.update({f"ema_{k}": v for k, v in averaged.items()})
    return result


def write_test_documents(accelerator, data, path):
    """The documents that the run evaluates on, a CSV row each (document, label), so that another
    model can be trained and tested on the same split (a folder's split is by content)."""
    labels = data.test_set.labels.tolist()
    rows = [[name, data.classes[y]] for name, y in zip(data.test_set.names, labels)]
    mine = rows if accelerator.is_main_process else []  # every process has them all
    write_csv(accelerator, mine, path, header=["document", "label"])  # a collective


def main(cfg):
    # 1. Runtime: processes and precision come from the accelerate config.
    if cfg.predict or cfg.export or cfg.check_data:  # from a --config file: the serving file's
        hand_over(SERVING)  # it runs in this process's place, with the same arguments
    accelerator = accelerator_for(cfg)  # build_accelerator() with the run's settings
    set_seed(cfg.seed)
    set_deterministic(cfg.deterministic, benchmark=False)  # lengths vary: no cuDNN autotuning
    out, checkpoint = open_run(accelerator, cfg)

    # 2. Data, and the settings settled once: every process reads every document (bad data
    # stops all alike); the loaders deal the batches out by length.
    cfg, data, train_loader, test_loader = settle(cfg, accelerator, checkpoint)
    metrics = start_logging(accelerator, cfg, NAME, checkpoint=checkpoint)
    write_test_documents(accelerator, data, out / "test_documents.csv")  # the split, for a baseline

    # 3. Model, optimizer and schedule.
    settings = model_settings(cfg)
    model = build_model(settings, len(data.classes), data.tokenizer)
    load_weights(model, cfg.weights)  # --weights, if given
    encoder = encoder_config(model)  # before prepare(): for the weights' record
    lr = cfg.scaled_lr(accelerator.num_processes)
    optimizer = make_optimizer(model, cfg, lr=lr, accelerator=accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)  # the loaders are sharded already
    ema = EMA.of(model, accelerator, cfg.ema_decay)  # the weights' moving average; None if 0
    scheduler = make_scheduler(optimizer, cfg)
    sizes = f"{len(data.train_set)} train / {len(data.test_set)} test documents"
    accelerator.print(
        f"{NAME}: {describe(accelerator, batches_line(cfg), cfg.global_batch_size)}; "
        f"{describe_model(model, settings, data.tokenizer)}; AdamW lr {lr:g}; {sizes} of "
        f"{len(data.classes)} classes ({', '.join(data.classes[:8])}"
        f"{' ...' * (len(data.classes) > 8)}); "
        f"outputs to {out}/"
    )
    for note in data.notes:
        accelerator.print(note)

    # 4. Resume: weights, optimizer, every rank's RNG, the LR schedule and the place in the data.
    progress = Progress(accelerator, cfg, metric="ema_accuracy" if ema else "accuracy")
    resume_or_start(  # and the LR schedule fitted to end where the run ends
        accelerator,
        checkpoint,
        cfg,
        progress=progress,
        scheduler=scheduler,
        batches_per_epoch=len(train_loader),
        recipe=NAME,
        data_order=DATA_ORDER,
        **same_data(data),
    )
    record = {"model": settings, "classes": data.classes, "tokenizer": data.tokenizer.record()}
    record["encoder"] = encoder  # a pretrained encoder's configuration, or None
    stored = record_metadata(RECORD, record, recipe=NAME)  # in every weights file, for predict

    # 5. Train, evaluating after every epoch.
    result = None
    while progress.epochs_left():
        catch_stop_signals()  # from here Ctrl-C and SIGTERM stop at a checkpoint, on every rank
        epoch, lr = progress.epoch, optimizer.param_groups[0]["lr"]
        loader = progress.rest_of_epoch(train_loader)  # set_epoch; a resumed epoch skips its start
        train = train_one_epoch(
            model,
            loader,
            optimizer,
            scheduler=scheduler,
            accelerator=accelerator,
            cfg=cfg,
            progress=progress,
            ema=ema,
            data=data,
        )
        if progress.interrupted:
            break
        reset_peak_memory(accelerator.device)  # eval_peak_memory_mb: evaluation's own peak
        result = evaluate_with_average(model, ema, test_loader, accelerator, loss_of(cfg.model))
        eval_peak = peak_memory_mb(accelerator.device)
        if progress.end_epoch(len(train_loader)):  # complete: max_steps can stop an epoch early
            save_best(  # best.safetensors, if this is the best evaluation so far
                accelerator, progress, result, model=model, ema=ema, out=out, metadata=stored
            )
            save(accelerator, cfg, progress=progress, scheduler=scheduler, data=data)
        metrics.write(
            epoch=epoch, step=progress.step, lr=lr, **train, **result, eval_peak_memory_mb=eval_peak
        )
        accelerator.log({f"eval/{k}": v for k, v in result.items()}, step=progress.step)
        accelerator.print(
            f"epoch {epoch}: train loss {train['train_loss']:.4f}, test accuracy "
            f"{result['accuracy']:.4f} ({result['eval_samples']} documents), "
            f"{train['train_tokens_per_s']:,.0f} tokens/s, padding {train['padding']:.1%}"
        )

    # 6. Finish: the final weights and accuracy, or where to resume an interrupted run.
    if progress.why_stopped:  # Ctrl-C or SIGTERM (then nothing more), or early stopping
        accelerator.print(progress.why_stopped)
    if not progress.interrupted:
        if result is None:  # eval_only, or a resumed run that had nothing left to train
            result = evaluate_with_average(model, ema, test_loader, accelerator, loss_of(cfg.model))
            metrics.write(
                epoch=None, step=progress.step, weights=str(cfg.weights or checkpoint), **result
            )
        if not cfg.eval_only:
            save_final(accelerator, model, ema, out, metadata=stored)  # and the moving average's
        accelerator.print(
            f"test accuracy {result['accuracy']:.4f} on {result['eval_samples']} documents; "
            f"outputs in {out}/"
        )

    # 7. Exit cleanly: drop what holds the process group, then close it.
    del model, optimizer, scheduler, train_loader, test_loader, data, ema
    close(accelerator)


if __name__ == "__main__":
    run(main, Config, serving=SERVING)  # --predict, --export, --check_data: SERVING runs
