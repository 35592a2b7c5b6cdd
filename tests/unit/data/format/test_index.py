"""The index contract (pipeline/data/format/index.py): what a shard directory must meet before training reads it."""

import pytest
from helpers import make_shard_dir

from pipeline.data.format.index import check_compatible, check_enough_samples, load_index


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return load_index(make_shard_dir(tmp_path_factory.mktemp("data"), num_samples=37))


def test_check_compatible(index):
    check_compatible(index, "test-tokenizer", 32)
    with pytest.raises(ValueError, match="'test-tokenizer', the experiment's tokenizer has 'llama'.*rebuild"):
        check_compatible(index, "llama", 32)
    with pytest.raises(ValueError, match="seq_len 32, the experiment uses 64.*point the experiment"):
        check_compatible(index, "test-tokenizer", 64)


def test_check_enough_samples(index):
    with pytest.raises(ValueError, match="37 samples, fewer than one global batch of 40"):
        check_enough_samples(index, 10 * 2 * 2)  # micro_batch 10 x grad_accum 2 x dp_world 2: preflight's check
    check_enough_samples(index, 37)
    with pytest.raises(ValueError, match=r"37 samples, 33 of them for training \(4 held out\), fewer than one global "
                                         r"batch of 36"):
        check_enough_samples(index, 36, num_samples=33)
