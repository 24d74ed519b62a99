import pytest

from moeserve.distributed.partition import default_layer_partition, stage_layer_ranges, validate_layer_partition


@pytest.mark.parametrize(
    "layers, pp, expected",
    [
        (61, 1, [61]),
        (61, 2, [31, 30]),  # no middle stage: stage 0 before the last
        (61, 4, [15, 16, 15, 15]),
        (61, 8, [7, 8, 8, 8, 8, 8, 7, 7]),  # remainder 5 onto stages 1..5
        (27, 4, [7, 7, 7, 6]),  # middle stages 1, 2 full, then stage 0
        (27, 3, [9, 9, 9]),
        (8, 8, [1] * 8),
        (10, 3, [3, 4, 3]),
    ],
)
def test_default_partition(layers, pp, expected):
    assert default_layer_partition(layers, pp) == expected


@pytest.mark.parametrize("layers", [1, 5, 27, 61, 64])
def test_default_partition_is_balanced_and_valid(layers):
    for pp in range(1, layers + 1):
        parts = default_layer_partition(layers, pp)
        assert validate_layer_partition(parts, layers, pp) == parts
        assert max(parts) - min(parts) <= 1
        extra = layers % pp
        if pp > 2 and extra and extra <= pp - 2:
            assert parts[0] == parts[-1] == layers // pp  # ends stay lean while middles absorb the remainder


def test_default_partition_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot split 4 layers into 5"):
        default_layer_partition(4, 5)
    with pytest.raises(ValueError, match="positive"):
        default_layer_partition(4, 0)


def test_stage_layer_ranges():
    assert stage_layer_ranges([7, 8, 8, 8, 8, 8, 7, 7]) == [(0, 7), (7, 15), (15, 23), (23, 31), (31, 39), (39, 47), (47, 54), (54, 61)]
    assert stage_layer_ranges([5]) == [(0, 5)]


@pytest.mark.parametrize(
    "partition, match",
    [
        ([30, 31, 0], "3 entries but pp=2"),
        ([30, 30], "covers 60 layers but the model has 61"),
        ([62, -1], "stage 1 has -1 layers"),
        ([61, 0], "stage 1 has 0 layers"),
        ([30.5, 30.5], "not an integer"),
        ("31,30", "list of integers"),
    ],
)
def test_validate_partition_errors(partition, match):
    pp = 2
    with pytest.raises(ValueError, match=match):
        validate_layer_partition(partition, 61, pp)


def test_validate_partition_accepts_uneven():
    assert validate_layer_partition((8, 8, 8, 8, 8, 8, 8, 5), 61, 8) == [8, 8, 8, 8, 8, 8, 8, 5]
