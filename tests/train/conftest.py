import dataclasses

import pytest

from parse_jax.tasks import load_task
from parse_jax.train.data import Encoder
from parse_jax.train.pipeline import load_tokenizer, model_config
from parse_jax.train.recipe import ModelSpec, PhaseSpec


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="session")
def task():
    return load_task()


@pytest.fixture(scope="session")
def enc(tok, task):
    return Encoder(tok, task)


@pytest.fixture(scope="session")
def tiny_cfg(tok):
    return model_config(ModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                  max_position_embeddings=64), tok)


@pytest.fixture
def tiny_spec():
    return dataclasses.replace(PhaseSpec(), steps=12, batch_size=8, lr=3e-3, warmup_steps=2, checkpoint_every=4,
                               keep_checkpoints=2, seed=3)
