"""tools/server.py: Server.metric reads /metrics with prometheus_client's parser."""

from __future__ import annotations

from vllm_kvbm.tools.server import Server

EXPOSITION = """\
# HELP kvbm_offload_blocks_d2h_total Blocks offloaded
# TYPE kvbm_offload_blocks_d2h_total counter
kvbm_offload_blocks_d2h_total{engine="0",model_name="my model } 1"} 3.0
kvbm_offload_blocks_d2h_total{engine="1",model_name="m"} 4.0 1700000000000
kvbm_offload_blocks_d2h_created{engine="0",model_name="m"} 1.7e+09
# HELP kvbm_offload_blocks_d2h_total_other Another counter sharing the prefix
# TYPE kvbm_offload_blocks_d2h_total_other gauge
kvbm_offload_blocks_d2h_total_other 100.0
# HELP kvbm_load_seconds Load time
# TYPE kvbm_load_seconds histogram
kvbm_load_seconds_bucket{le="0.1"} 2.0
kvbm_load_seconds_bucket{le="+Inf"} 3.0
kvbm_load_seconds_count 3.0
kvbm_load_seconds_sum 0.25
"""


def test_metric_total_sums_one_sample_name_over_label_sets():
    # a label value with a space and a brace, and a sample with a timestamp,
    # are each one sample of its value; a longer name sharing the prefix is not it
    assert Server.metric_total(EXPOSITION, "kvbm_offload_blocks_d2h_total") == 7.0
    assert Server.metric_total(EXPOSITION, "kvbm_load_seconds_count") == 3.0
    assert Server.metric_total(EXPOSITION, "kvbm_load_seconds_sum") == 0.25
    assert Server.metric_total(EXPOSITION, "kvbm_absent_total") == 0.0


def test_metric_total_of_the_label_sets_that_have_given_labels():
    assert Server.metric_total(EXPOSITION, "kvbm_offload_blocks_d2h_total", engine="1") == 4.0
    assert (
        Server.metric_total(
            EXPOSITION, "kvbm_offload_blocks_d2h_total", engine="0", model_name="my model } 1"
        )
        == 3.0
    )
    assert Server.metric_total(EXPOSITION, "kvbm_offload_blocks_d2h_total", engine="2") == 0.0
