"""Bad input to every verb: exit status 2, one line on stderr naming the value, no traceback, no file harmed.

Each case is ``(argv, named)``: ``{T}`` in an argument stands for a scratch directory holding files
the command must leave alone (one of them given as an output path where a verb writes), and
``named`` is text the error line must contain: the offending value, or the file it came from.
The cases run in-process through ``dlperf.cli.main``; a few also run as a real ``dlperf`` process.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dlperf.cli import main
from dlperf.data.fashion_mnist import FILES
from dlperf.data.idx import write_idx
from dlperf.devices import cpu_count

ROOT = Path(__file__).resolve().parents[1]
LONG = "9" * 5000
FAKE_AVAILABLE = 2**30  # memory checks see 1 GiB available, whatever this machine has

OUT = "{T}/out.json"  # an existing file passed as an output path: it must survive every refusal


def _bench(*argv):
    return ["bench", "--networks", "mlp", "--devices", "cpu", "--json", OUT, *argv]


def _scaling(*argv):
    return ["bench", "--scaling", "--networks", "fcn-r", "--devices", "cpu:0,cpu:1", "--steps", "1", *argv]


def _train(*argv):
    return ["train", "--epochs", "1", "--train-size", "100", "--test-size", "50", "--batch-size", "10",
            "--no-progress", "--checkpoint", "{T}/ck.pt", *argv]


def _export(*argv):
    return ["export", "mlp", "{T}/export", *argv]


BENCH = [
    (_bench("--networks", ","), "','"),
    (_bench("--networks", ""), "''"),
    (_bench("--networks", " "), "' '"),
    (_bench("--networks", "lenet,,mlp"), "'lenet,,mlp'"),
    (_bench("--networks", "lenet,"), "'lenet,'"),
    (_bench("--networks", "nope"), "'nope'"),
    (_bench("--networks", "lenet,lenet"), "'lenet'"),
    (_bench("--networks", "le\nnet"), "'le\\nnet'"),
    (_bench("--devices", ","), "','"),
    (_bench("--devices", ""), "''"),
    (_bench("--devices", "tpu:0"), "'tpu:0'"),
    (_bench("--devices", "cpu:0,cpu:0"), "'cpu:0'"),
    (_bench("--devices", "cpu:0,cpu"), "cpu(0)"),
    (_bench("--devices", "cpu:99999"), "'cpu:99999'"),
    (_bench("--devices", "cpu:" + LONG), "'cpu:999"),
    (_bench("--devices", "cpu:-1"), "'cpu:-1'"),
    (_bench("--devices", "cpu:0x1"), "'cpu:0x1'"),
    (_bench("--devices", "gpu:1000"), "gpu(1000)"),
    (_bench("--threads", "0"), "'0'"),
    (_bench("--threads", "-1"), "'-1'"),
    (_bench("--threads", "1.5"), "'1.5'"),
    (_bench("--threads", ","), "','"),
    (_bench("--threads", "1,,2"), "'1,,2'"),
    (_bench("--threads", "abc"), "'abc'"),
    (_bench("--threads", "100000"), "'100000'"),
    (_bench("--threads", "1,1"), "'1'"),
    (_bench("--threads", "9" * 30), "'999"),
    (_bench("--threads", "1e2"), "'1e2'"),
    (_bench("--batch-size", "0"), "'0'"),
    (_bench("--batch-size", "-5"), "'-5'"),
    (_bench("--batch-size", "1e3"), "'1e3'"),
    (_bench("--batch-size", "nan"), "'nan'"),
    (_bench("--batch-size", str(2**21)), f"'{2**21}'"),
    (_bench("--batch-size", ""), "''"),
    (_bench("--batch-size", LONG), "'999"),
    (_bench("--batch-size", "1048576"), "--batch-size 1048576"),
    (_bench("--steps", "0"), "'0'"),
    (_bench("--steps", "-1"), "'-1'"),
    (_bench("--steps", "1.0"), "'1.0'"),
    (_bench("--steps", "inf"), "'inf'"),
    (_bench("--steps", "100001"), "'100001'"),
    (_bench("--warmup", "-1"), "'-1'"),
    (_bench("--warmup", "x"), "'x'"),
    (_bench("--warmup", "0"), "--warmup 0: expected steps >= 1 and warmup >= 1"),
    (_bench("--mode", "nope"), "'nope'"),
    (_bench("--mode", ""), "''"),
    (_bench("--csv", ""), "''"),
    (_bench("--csv", "{T}/adir"), "adir"),
    (_bench("--csv", "{T}/notes.txt/x.csv"), "notes.txt"),
    (_bench("--markdown", "{T}/adir/"), "adir/"),
    (_bench("--plot", "{T}/adir"), "adir"),
    (_bench("--plot", ""), "''"),
    (_bench("--csv", "{T}/same.txt", "--markdown", "{T}/same.txt"), "same.txt"),
    (_bench("--csv", OUT), "out.json"),
    (["bench", "--json", "{T}/adir"], "adir"),
    (["bench", "--json", ""], "''"),
    (["bench", "--bogus-flag"], "--bogus-flag"),
    (["bench", "extra"], "extra"),
    (["bench", "--quick=1"], "'1'"),
    (["bench", "--networks"], "--networks"),
]

SCALING = [
    (_scaling("--networks", "lenet"), "'lenet'"),
    (_scaling("--networks", "alexnet-r,,"), "'alexnet-r,,'"),
    (_scaling("--networks", "nope"), "'nope'"),
    (_scaling("--mode", "hybrid"), "--mode hybrid"),
    (_scaling("--threads", "1"), "--threads"),
    (_scaling("--csv", "{T}/adir"), "adir"),
    (_scaling("--markdown", ""), "''"),
    (_scaling("--plot", "{T}/adir"), "adir"),
    (_scaling("--batch-size", "1"), "--batch-size 1: expected at least the 2 devices"),
    (_scaling("--batch-size", "0"), "'0'"),
    (_scaling("--batch-size", "1048576"), "--batch-size 1048576"),
    (_scaling("--steps", "0"), "'0'"),
    (_scaling("--steps", "1e9"), "'1e9'"),
    (_scaling("--warmup", "-1"), "'-1'"),
    (_scaling("--devices", ","), "','"),
    (_scaling("--devices", "cpu:0,cpu:0"), "'cpu:0'"),
    (_scaling("--devices", "gpu:1000"), "gpu(1000)"),
    (_scaling("--json", "{T}/adir"), "adir"),
    (_scaling("--json", ""), "''"),
    (_scaling("--json", OUT, "--mode", "compile"), "--mode compile"),
    (_scaling("--json", OUT, "--mode", "auto"), "--mode auto"),
    (_bench("--explain=yes"), "--explain"),
]

DEVICES = [
    (["devices", "--json=yes"], "'yes'"),
    (["devices", "extra"], "extra"),
    (["devices", "--bogus"], "--bogus"),
    (["devices", "--json", "--all"], "--all"),
]

TRAIN = [
    (_train("--lr", "1e300"), "'1e300'"),
    (_train("--lr", "nan"), "'nan'"),
    (_train("--lr", "NaN"), "'NaN'"),
    (_train("--lr", "inf"), "'inf'"),
    (_train("--lr=-inf"), "'-inf'"),
    (_train("--lr", "0"), "'0'"),
    (_train("--lr", "-0.1"), "'-0.1'"),
    (_train("--lr", "abc"), "'abc'"),
    (_train("--lr", ""), "''"),
    (_train("--lr", "1e-400"), "'1e-400'"),
    (_train("--lr", "101"), "'101'"),
    (_train("--lr", LONG), "'999"),
    (_train("--lr", "0x10"), "'0x10'"),
    (_train("--seed", str(2**64)), f"'{2**64}'"),
    (_train("--seed", str(2**70)), f"'{2**70}'"),
    (_train("--seed", "-1"), "'-1'"),
    (_train("--seed", "1.5"), "'1.5'"),
    (_train("--seed", "abc"), "'abc'"),
    (_train("--seed", LONG), "'999"),
    (_train("--epochs", "0"), "'0'"),
    (_train("--epochs", "-3"), "'-3'"),
    (_train("--epochs", "1e6"), "'1e6'"),
    (_train("--epochs", "100001"), "'100001'"),
    (_train("--epochs", "1\n2"), "'1\\n2'"),
    (_train("--batch-size", "0"), "'0'"),
    (_train("--batch-size", "1.5"), "'1.5'"),
    (_train("--batch-size", str(2**25)), f"'{2**25}'"),
    (_train("--batch-size", "1000000"), "--batch-size 1000000"),
    (_train("--train-size", "0"), "'0'"),
    (_train("--train-size", str(10**13)), f"'{10**13}'"),
    (_train("--train-size", str(10**11)), f"--train-size {10**11}"),
    (_train("--test-size", "0"), "'0'"),
    (_train("--test-size", "-1"), "'-1'"),
    (_train("--test-size", str(10**11)), f"--test-size {10**11}"),
    (_train("--devices", ""), "''"),
    (_train("--devices", ","), "','"),
    (_train("--devices", "cpu:0,,cpu:1"), "'cpu:0,,cpu:1'"),
    (_train("--devices", "npu"), "'npu'"),
    (_train("--devices", "cpu:0,cpu"), "cpu(0)"),
    (_train("--devices", "gpu:1000"), "gpu(1000)"),
    (_train("--devices", "cpu:2000"), "'cpu:2000'"),
    (_train("--devices", "cpu:0,cpu:1,cpu:2", "--batch-size", "2"), "--batch-size 2"),
    (_train("--model", "vgg"), "'vgg'"),
    (_train("--algorithm", "tree"), "'tree'"),
    (_train("--algorithm", ""), "''"),
    (_train("--kvstore", "remote"), "'remote'"),
    (_train("--data", "{T}/notes.txt"), "notes.txt"),
    (_train("--data", "{T}/nonexistent"), "nonexistent"),
    (_train("--download"), "--download"),
    (_train("--data", "{T}/idx_empty"), "idx_empty"),
    (_train("--data", "{T}/idx_label12"), "label 12"),
    (_train("--data", "{T}/idx_32x32"), "(2, 32, 32)"),
    (_train("--data", "{T}/idx_magic"), "idx_magic"),
    (_train("--data", "{T}/idx_truncated"), "idx_truncated"),
    (_train("--data", "{T}/idx_bomb"), "idx_bomb"),
    (_train("--data", "{T}/idx_huge_header"), "idx_huge_header"),
    (_train("--data", "{T}/idx_count_mismatch"), "3 labels"),
    (_train("--data", "{T}/idx_float_labels"), "idx_float_labels"),
    (_train("--data", "{T}/adir"), "adir"),
    (_train("--checkpoint", "{T}/adir"), "adir"),
    (_train("--checkpoint", ""), "''"),
    (_train("--checkpoint", "{T}/notes.txt/ck.pt"), "notes.txt"),
    (_train("--resume", "{T}/adir"), "adir"),
    (_train("--resume", "{T}/missing.pt"), "missing.pt"),
    (_train("--resume", "{T}/notes.txt"), "notes.txt"),
    (_train("--resume", ""), "''"),
    (_train("--resume", "{T}/fifo"), "fifo"),
    (_train("--no-progress=1"), "'1'"),
    (_train("--checkpoint", OUT, "--lr", "nan"), "'nan'"),
    # a plan given by name is checked against this machine and run before anything starts
    (_train("--plan", "1x1024"), "--plan 1x1024,contiguous,eager: 1024 threads for each replica"),
    (_train("--plan", "64x1"), "64 replicas, more than the 10 examples of a batch"),
    (_train("--plan", "1x1,bf16"), "bf16 mixed precision, which is planned for GPUs, on CPU devices"),
    (_train("--plan", "1x1,fp16"), "fp16, which needs loss scaling"),
    (_train("--plan", "1x1,kvstore-dist_sync"), "kvstore dist_sync, a distributed store"),
    (_train("--plan", "1x1,kvstore-nosuch"), "kvstore 'nosuch', not a store type here"),
    (_train("--plan", "2x1,processes", "--kvstore", "local"), "kvstore local, which sums one process's devices"),
    (_train("--plan", "1x1,captured", "--check-finite"), "a captured step, which cannot hold its update back"),
]

SCALE = [
    (["scale", "--gradients", "160MB", "--step-ms", "100", "--hosts", "4", "--cores-per-host", "1e-300"],
     "'1e-300' is out of range; give --cores-per-host a number >= 1"),
    (["scale", "--gradients", "160MB", "--step-ms", "100", "--hosts", "4", "--cores-per-host", "0.5"], "'0.5'"),
]

EXPORT = [
    (["export", "nonet", "{T}/export"], "'nonet'"),
    (["export", "", "{T}/export"], "''"),
    (["export", "mlp", "{T}/notes.txt"], "notes.txt"),
    (["export", "mlp", OUT], "out.json"),
    (["export", "mlp"], "DIRECTORY"),
    (["export"], "MODEL"),
    (_export("--batch", "0"), "'0'"),
    (_export("--batch", "-1"), "'-1'"),
    (_export("--batch", "1e9"), "'1e9'"),
    (_export("--batch", str(2**25)), f"'{2**25}'"),
    (_export("--batch", "1000000"), "--batch 1000000"),
    (_export("--batch", ""), "''"),
    (_export("--batch", LONG), "'999"),
    (_export("--seed", "-1"), "'-1'"),
    (_export("--seed", str(2**64)), f"'{2**64}'"),
    (_export("--weights", "{T}/missing.pt"), "missing.pt"),
    (_export("--weights", "{T}/adir"), "adir"),
    (_export("--weights", "{T}/notes.txt"), "notes.txt"),
    (_export("--weights", ""), "''"),
    (["export", "mlp", "{T}/notes.txt/sub"], "notes.txt"),
    (["export", "mlp", ""], "''"),
    (_export("--pt2=yes"), "'yes'"),
]

TRACE_FILES = {
    "nan.json": '{"traceEvents": [{"ph": "X", "ts": NaN, "dur": 1}]}',
    "infinity.json": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": Infinity}]}',
    "neg_infinity.json": '{"traceEvents": [{"ph": "X", "ts": -Infinity, "dur": 1}]}',
    "overflow.json": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1e999}]}',
    "neg_dur.json": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": -100}]}',
    "neg_ts.json": '{"traceEvents": [{"ph": "X", "ts": -5, "dur": 1}]}',
    "absurd_ts.json": '{"traceEvents": [{"ph": "X", "ts": 1e300, "dur": 1}]}',
    "digits_ts.json": '{"traceEvents": [{"ph": "X", "ts": ' + LONG + ', "dur": 1}]}',
    "digits_dur.json": '{"traceEvents": [{"ph": "X", "ts": 0, "dur": ' + LONG + '}]}',
    "digits_id.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"id": ' + LONG + '}}]}',
    "deep.json": "[" * 100000 + "]" * 100000,
    "deep_object.json": '{"a":' * 50000 + "1" + "}" * 50000,
    "deep_args.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"x": ' + "[" * 500 + "]" * 500 + "}}]}",
    "not_json.json": "{not json",
    "empty.json": "",
    "events_number.json": '{"traceEvents": 3}',
    "no_ops.json": '{"traceEvents": []}',
    "only_meta.json": '{"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1}]}',
    "ts_string.json": '{"traceEvents": [{"ph": "X", "ts": "0", "dur": 1}]}',
    "ts_bool.json": '{"traceEvents": [{"ph": "X", "ts": true, "dur": 1}]}',
    "no_ts.json": '{"traceEvents": [{"ph": "X", "dur": 1}]}',
    "id_negative.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"id": -1}}]}',
    "id_fraction.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"id": 1.5}}]}',
    "deps_number.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"deps": 3}}]}',
    "deps_strings.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"deps": ["a"]}}]}',
    "pid_list.json": '{"traceEvents": [{"ph": "X", "ts": 0, "pid": [1], "tid": 1}]}',
    "args_string.json": '{"traceEvents": [{"ph": "X", "ts": 0, "args": "x"}]}',
    "top_number.json": "3",
    "top_string.json": '"trace"',
    "events_of_numbers.json": "[1, 2]",
    "not_utf8.json": b"\xff\xfe\x00",
    "end_overflows.json": '{"traceEvents": [{"ph": "X", "ts": 1e15, "dur": 1e15}]}',
}

TRACE = [(["trace", f"{{T}}/{name}"], name) for name in TRACE_FILES] + [
    (["trace", "{T}/missing.json"], "missing.json"),
    (["trace", "{T}/adir"], "adir"),
    (["trace", ""], "''"),
    (["trace", "{T}/fifo"], "fifo"),
    (["trace"], "FILE"),
    (["trace", "{T}/no_ops.json", "extra"], "extra"),
    (["trace", "{T}/no_ops.json", "--json=1"], "'1'"),
]

TOP = [
    ([], "VERB"),
    (["nosuchverb"], "'nosuchverb'"),
    (["--bogus"], "--bogus"),
    (["bench\n"], "'bench\\n'"),
]

NAME_TOO_LONG = "{T}/" + "a" * 300  # one component beyond the file system's 255 bytes
PATHS = [
    (_train("--resume", NAME_TOO_LONG), "'{T}/aaa"),
    (_train("--checkpoint", NAME_TOO_LONG), "'{T}/aaa"),
    (_train("--data", NAME_TOO_LONG), "'{T}/aaa"),
    (["trace", NAME_TOO_LONG], "'{T}/aaa"),
    (["export", "mlp", NAME_TOO_LONG], "'{T}/aaa"),
    (_export("--weights", NAME_TOO_LONG), "'{T}/aaa"),
    (_bench("--csv", NAME_TOO_LONG + "/x.csv"), "'{T}/aaa"),
    (_train("--checkpoint", "/dev/null"), "'/dev/null'"),
    (["trace", "/dev/zero"], "'/dev/zero'"),
    (_train("--data", "/dev/null"), "'/dev/null'"),
    (_train("--resume", "{T}/" + "x" * 5000), "'{T}/xxx"),
    (_bench("--networks", "\udcff"), "'\\udcff'"),
    (_train("--lr", "\udcff"), "'\\udcff'"),
]

def _profile(*argv):
    return ["profile", "dlperf.models.lenet:lenet", "--input", "2x1x28x28", *argv]


_HW = {"flops": {"float32": 1e11}, "memory_bandwidth": 2e10, "dispatch_s": 1e-5,
       "links": {"copy": {"alpha_s": 1e-7, "bandwidth": 1e10}}}
# --hardware files whose figures no machine shows (a floor of 0 or of forever), and other hostile ones
HARDWARE_FILES = {
    "hw_tiny_dispatch.json": (json.dumps({**_HW, "dispatch_s": 5e-324}), "dispatch_s is 5e-324 seconds"),
    "hw_huge_flops.json": (json.dumps({**_HW, "flops": {"float32": 1e308}}), "flops['float32'] is 1e+308 FLOP/s"),
    "hw_zero_bandwidth.json": (json.dumps({**_HW, "memory_bandwidth": 0}), "memory_bandwidth is 0"),
    "hw_negative.json": (json.dumps({**_HW, "dispatch_s": -1}), "dispatch_s is -1"),
    "hw_tiny_bandwidth.json": (json.dumps({**_HW, "memory_bandwidth": 1e-3}), "memory_bandwidth is 0.001 bytes/s"),
    "hw_huge_link.json": (json.dumps({**_HW, "links": {"copy": {"alpha_s": 1e9, "bandwidth": 1e10}}}),
                          "links['copy'].alpha_s is 1000000000.0 seconds"),
    "hw_link_bandwidth.json": (json.dumps({**_HW, "links": {"network": {"alpha_s": 0, "bandwidth": 5e-324}}}),
                               "links['network'].bandwidth is 5e-324"),
    "hw_nan.json": ('{"flops": {"float32": NaN}, "memory_bandwidth": 2e10, "dispatch_s": 1e-5}', "NaN is not a number"),
    "hw_infinity.json": ('{"flops": {"float32": 1e11}, "memory_bandwidth": Infinity, "dispatch_s": 1e-5}',
                         "Infinity is not a number"),
    "hw_duplicate.json": ('{"flops": {"float32": 1e11}, "memory_bandwidth": 2e10, "memory_bandwidth": 0, '
                          '"dispatch_s": 1e-5}', "'memory_bandwidth' appears twice"),
    "hw_long_name.json": (json.dumps({**_HW, "name": "n" * 300}), "'name' is longer than 200"),
    "hw_name_number.json": (json.dumps({**_HW, "name": 3}), "'name' must be a string"),
    "hw_not_utf8.json": ("\udcff", "hw_not_utf8.json"),
    "hw_list.json": ("[1, 2]", "mapping"),
    "hw_too_big.json": (" " * (1 << 20) + "{}", "larger than 1048576 bytes"),
}
HOSTILE_FILES = [(_profile("--hardware", f"{{T}}/{name}"), named) for name, (_, named) in HARDWARE_FILES.items()] + [
    (_profile("--hardware", "{T}/fifo"), "fifo"),
    (_bench("--json", "{T}/sock"), "it is a socket"),
    (_bench("--csv", "{T}/sock"), "'{T}/sock'"),
    (["probe", "--json", "{T}/sock"], "it is a socket"),
    (_profile("--json", "{T}/sock"), "it is a socket"),
    (_profile("--trace", "{T}/adir"), "is a directory"),
    (_train("--checkpoint", "/dev/stdout"), "is this process's stdout or stderr"),
    (_train("--checkpoint", "{T}/fifo"), "'{T}/fifo' is not a regular file"),
]

LENET = "dlperf.models.lenet:lenet"  # an importable factory: what a user's own module:factory stands for


def _user_bench(*argv):
    return ["bench", "--networks", LENET, "--devices", "cpu", "--threads", "1", "--json", OUT, *argv]


def _user_profile(*inputs):
    return ["profile", LENET, "--steps", "1", "--no-suggest", *[a for i in inputs for a in ("--input", i)]]


def _launch(*command):
    return ["launch", "--nproc-per-node", "2", "--", *command]


# the user's own model, batch and launch habits: --networks MODULE:FACTORY, --input specs and factories, python
USER = [
    (_user_bench(), "needs its batch"),
    (_bench("--input", "4x1x28x28"), "none is"),
    (_user_bench("--input", "4x1x28x28:float99"), "'float99'"),
    (_user_bench("--input", "0x1x28x28"), "'0x1x28x28'"),
    (_user_bench("--input", "4x3:int64:9-1"), "'9-1'"),
    (_user_bench("--input", "4x3:float32:0-9"), "'4x3:float32:0-9'"),
    (_user_bench("--input", "4x3"), "float32[4,3]"),
    (_user_bench("--input", "1024x1024x1024"), "--input 1024x1024x1024 needs about 16.0 GiB"),
    (_user_profile("1024x1024x64:int64"), "--input 1024x1024x64:int64 needs about 2.0 GiB"),
    (_user_bench("--input", "4x1x28x28", "--input", LENET), LENET),
    (_user_bench("--input", "4x" + LONG), "'4x999"),
    (_user_bench("--input", "4x1x28x28:int64:0-1:3"), "'4x1x28x28:int64:0-1:3'"),
    (_user_bench("--input", "dlperf.models.lenet:missing_batch"), "'missing_batch'"),
    (_user_bench("--input", "dlperf models:x"), "'dlperf models:x'"),
    (_bench("--networks", "no_such_module_xyz:make", "--input", "4x3"), "'no_such_module_xyz'"),
    (_bench("--networks", "dlperf.models.lenet:nope", "--input", "4x3"), "'nope'"),
    (_bench("--networks", "a b:c", "--input", "4x3"), "'a b:c'"),
    (_bench("--networks", "mlp," + LENET + ",mlp", "--input", "4x3"), "'mlp'"),
    (_bench("--networks", "lenet:", "--input", "4x3"), "'lenet:'"),
    (_user_profile("4x1x28x28:complex7"), "'complex7'"),
    (_user_profile("4x1x28x28:bool:0-1"), "ranges are for integer"),
    (_user_profile("4x1x28x28:int8:0-300"), "int8"),
    (_user_profile("4x1x28x28:int64:-5-x"), "'-5-x'"),
    (_user_profile("1e3"), "'1e3'"),
    (_user_profile("4x1x28x28", "2x5"), "batch sizes 2, 4"),
    (_user_profile("dlperf.models.lenet:missing"), "has no attribute 'missing'"),
    (_user_profile(LENET, "4x3"), "a batch factory makes the whole batch"),
    (_user_profile("4x3:int64"), "int64[4,3]"),
    (_launch("python"), "python with no script"),
    (_launch("python3", "-c", "print(1)"), "'-c'"),
    (_launch(sys.executable, "-X", "dev", "s.py"), "'-X'"),
    (_launch("python", "-m", "1bad"), "'1bad'"),
    (_launch("python", "-m", "no_such_module_for_launch_xyz"), "'no_such_module_for_launch_xyz'"),
    (_launch("python", "{T}/missing_script.py"), "missing_script.py"),
    (_launch("python3.99", "-m"), "expected a module name"),
]

HOSTILE = "support.hostile_models:"  # tests/support/hostile_models.py: factories that go wrong as users' do


def _factories(*argv):
    return ["train", "--epochs", "1", "--no-progress", *argv]


def _scale(*argv):
    return ["scale", "--hosts", "2", "--link", "10gbit", *argv]


# the user's model, loss or data raising, or training nothing: one line naming the call and the batch, or why
USER_CODE = [
    (_factories("--data", HOSTILE + "labels_out_of_range"),
     "the loss classification_loss(output float32[8,10], targets int64[8]) raised IndexError: Target 12 is out"),
    (_factories("--data", HOSTILE + "labels_negative"), "raised IndexError: Target -3 is out of bounds"),
    (_factories("--devices", "cpu:0,cpu:1", "--data", HOSTILE + "labels_out_of_range"),  # raised on engine workers
     "(output float32[4,10], targets int64[4]) raised IndexError: Target 12 is out of bounds"),
    (_factories("--data", HOSTILE + "labels_float"), "cross-entropy needs integer class labels (0 to 9)"),
    (_factories("--model", HOSTILE + "one_column", "--data", HOSTILE + "labels_out_of_range"),
     "the default loss, cross-entropy, needs integer class labels [B] beside scores [B, C] with C >= 2"),
    (_factories("--data", HOSTILE + "wrong_shape"), "the model Sequential(float32[8,3,32,32]) raised RuntimeError"),
    (_factories("--data", HOSTILE + "dict_inputs"), "the model Sequential(dict{x: float32[8,1,28,28]}) raised"),
    (_factories("--model", HOSTILE + "no_parameters"), "has no trainable parameters (no parameters at all)"),
    (_factories("--model", HOSTILE + "frozen"), "has no trainable parameters (every one has requires_grad=False)"),
    (_factories("--model", HOSTILE + "on_meta_device"), "built a model on the meta device"),
    (_factories("--model", HOSTILE + "parameters_raise"), "parameters() raised RuntimeError: parameters() is broken"),
    (_factories("--model", HOSTILE + "fails_on_call_4", "--data", HOSTILE + "dry_after_one_epoch"),
     "the model FailsOnCall(float32[8,1,28,28]) raised ValueError: forward fails on call 4"),
    (_factories("--data", HOSTILE + "data_raising"), "the train data (epoch 1, batch 2) raised OSError: damaged"),
    (_factories("--data", HOSTILE + "no_batches"), "the training data gave no batch in epoch 1"),
    (_factories("--data", HOSTILE + "empty_batches"), "every batch of epoch 1 (3) holds 0 examples"),
    (_factories("--data", HOSTILE + "dry_after_one_epoch", "--epochs", "2"),
     "the training data gave no batch in epoch 2 (it did in epoch 1)"),
    (_factories("--data", HOSTILE + "dry_without_a_test_set"), "the test data gave no example after epoch 1"),
    (["train", "--epochs", "1", "--no-progress", "--train-size", "128", "--test-size", "64", "--batch-size", "64",
      "--plan", "1024x1"], "1024"),
    (["profile", HOSTILE + "fails_on_call_3", "--input", "8x1x28x28", "--steps", "3", "--no-suggest"],
     "the model FailsOnCall(float32[8,1,28,28]) raised ValueError: forward fails on call 3"),
    (_scale("--model", HOSTILE + "fails_on_call_4", "--input", "8x1x28x28"), "forward fails on call 4"),
    (_scale("--model", HOSTILE + "no_parameters", "--input", "8x1x28x28"), "has no trainable parameters"),
    (_scale("--model", "lenet", "--batch-size", "65536"), "--batch-size 65536 on lenet needs about"),
    (_scale("--model", HOSTILE + "two_inputs", "--input", "64x1024x1024", "--input", "64x1024x1024"),
     "--input 64x1024x1024 --input 64x1024x1024 needs about"),
]

CASES = BENCH + SCALING + DEVICES + TRAIN + SCALE + EXPORT + TRACE + TOP + PATHS + HOSTILE_FILES + USER + USER_CODE
# In-process only: a NUL cannot be passed to a process, and pytest's own arguments could not either.
IN_PROCESS_ONLY = [
    (_train("--checkpoint", "{T}/ck\0.pt"), "ck\\x00.pt'"),
    (["trace", "{T}/a\0b.json"], "a\\x00b.json'"),
    (_export("--weights", "{T}/w\0.pt"), "w\\x00.pt'"),
]


def _idx_dir(root: Path, images: np.ndarray, labels: np.ndarray, test: tuple | None = None) -> None:
    root.mkdir()
    test_images, test_labels = test if test is not None else (images, labels)
    write_idx(root / FILES["train_images"], images)
    write_idx(root / FILES["train_labels"], labels)
    write_idx(root / FILES["test_images"], test_images)
    write_idx(root / FILES["test_labels"], test_labels)


def _gzip_bomb(path: Path, header_count: int, expanded_bytes: int) -> None:
    """An IDX .gz whose header declares ``header_count`` images but whose stream expands much further."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(bytes([0, 0, 8, 3]) + header_count.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)
        zeros = bytes(1 << 20)
        for _ in range(expanded_bytes >> 20):
            f.write(zeros)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    t = tmp_path_factory.mktemp("sweep")
    (t / "adir").mkdir()
    (t / "notes.txt").write_text("keep me\n")
    (t / "out.json").write_text('{"precious": true}\n')
    (t / "same.txt").write_text("also kept\n")
    os.mkfifo(t / "fifo")
    for name, content in TRACE_FILES.items():
        (t / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    for name, (text, _) in HARDWARE_FILES.items():
        (t / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(t / "sock"))
    sock.close()  # the socket file stays
    images = np.zeros((2, 28, 28), np.uint8)
    labels = np.array([1, 2], np.uint8)
    _idx_dir(t / "idx_empty", np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.uint8))
    _idx_dir(t / "idx_label12", images, np.array([1, 12], np.uint8))
    _idx_dir(t / "idx_32x32", np.zeros((2, 32, 32), np.uint8), labels)
    _idx_dir(t / "idx_count_mismatch", images, np.array([1, 2, 3], np.uint8))
    _idx_dir(t / "idx_float_labels", images, np.array([1.0, 2.0], np.float32))
    for name in ("idx_magic", "idx_truncated", "idx_bomb", "idx_huge_header"):
        _idx_dir(t / name, images, labels)
    (t / "idx_magic" / FILES["train_images"]).write_bytes(b"PK\x03\x04" + bytes(100))
    full = (t / "idx_truncated" / FILES["train_images"]).read_bytes()
    (t / "idx_truncated" / FILES["train_images"]).write_bytes(full[:-10])
    (t / "idx_bomb" / FILES["train_images"]).unlink()
    _gzip_bomb(t / "idx_bomb" / (FILES["train_images"] + ".gz"), 2, 64 << 20)
    (t / "idx_huge_header" / FILES["train_images"]).unlink()
    _gzip_bomb(t / "idx_huge_header" / (FILES["train_images"] + ".gz"), 2**32 - 1, 1 << 20)
    return t


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_fifo()}


def _argv(argv: list[str], root: Path) -> list[str]:
    return [a.replace("{T}", str(root)) for a in argv]


def _check_one_line(rc: int, out: str, err: str, named: str, root: Path) -> None:
    assert "Traceback" not in out + err, err
    assert rc == 2, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert "error:" in lines[0]
    assert named.replace("{T}", str(root)) in lines[0], (named, lines[0])


@pytest.fixture
def limited_memory(monkeypatch):
    import dlperf._cliargs

    monkeypatch.setattr(dlperf._cliargs, "available_memory_bytes", lambda: FAKE_AVAILABLE)


def _ids(cases):
    return [" ".join(argv)[:80].replace("\n", "\\n").replace("\0", "\\0") for argv, _ in cases]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, named", CASES + IN_PROCESS_ONLY, ids=_ids(CASES + IN_PROCESS_ONLY))
def test_bad_input_is_one_line_exit_2_and_harms_nothing(argv, named, scratch, capsys, limited_memory):
    before = _hashes(scratch)
    rc = main(_argv(argv, scratch))
    captured = capsys.readouterr()
    _check_one_line(rc, captured.out, captured.err, named, scratch)
    assert _hashes(scratch) == before
    assert not (scratch / "export").exists() and not (scratch / "ck.pt").exists()


def test_the_sweep_is_broad():
    verbs = {argv[0] for argv, _ in CASES if argv}
    assert len(CASES) + len(IN_PROCESS_ONLY) >= 150
    assert len({tuple(argv) for argv, _ in CASES}) == len(CASES)
    assert verbs == {"bench", "devices", "train", "export", "trace", "profile", "probe", "launch", "scale",
                     "nosuchverb", "--bogus", "bench\n"}
    assert len(SCALING) >= 15


# Real-memory cases are refused on any machine (hundreds of GB to hundreds of TB).
SUBPROCESS_CASES = [
    (_train("--lr", "nan"), "'nan'"),
    (_train("--train-size", str(10**12)), f"--train-size {10**12}"),
    (["bench", "--batch-size", "1048576", "--networks", "alexnet-s", "--devices", "cpu"], "--batch-size 1048576"),
    (["export", "mlp", OUT], "out.json"),
    (_user_bench("--input", "4x3:int64:9-1"), "'9-1'"),
    (_user_profile("4x3:int64"), "int64[4,3]"),
    (_launch("python", "-c", "1"), "'-c'"),
]


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_real_processes_exit_2_with_one_line(scratch):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = _hashes(scratch)
    procs = [subprocess.Popen([sys.executable, "-m", "dlperf.cli", *_argv(argv, scratch)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _ in SUBPROCESS_CASES]
    for proc, (_, named) in zip(procs, SUBPROCESS_CASES):
        out, err = proc.communicate(timeout=150)
        _check_one_line(proc.returncode, out, err, named, scratch)
    assert _hashes(scratch) == before


@pytest.mark.parametrize("argv", [["--input", "8x12", "--input", "8x4"], ["--input", HOSTILE + "two_tensors"]],
                         ids=["two --input", "a batch factory's tuple"])
def test_scale_measures_a_model_of_several_inputs(argv, capsys):
    """The title names the batch of a tuple (or dict) of inputs: their common first axis, not a tensor's shape."""
    assert main(_scale("--model", HOSTILE + "two_inputs", *argv, "--step-ms", "5")) == 0
    assert "batch 8 per device" in capsys.readouterr().out


def test_scale_measures_a_model_of_a_dict_batch(capsys):
    assert main(_scale("--model", HOSTILE + "dict_input", "--input", HOSTILE + "dict_batch")) == 0
    assert "batch 8 per device" in capsys.readouterr().out


def test_train_names_the_devices_a_plan_ran_on(capsys):
    """--plan 2x1 with three devices named trains on two, and the last line says which."""
    assert main(["train", "--epochs", "1", "--no-progress", "--train-size", "64", "--test-size", "32", "--batch-size",
                 "32", "--plan", "2x1", "--devices", "cpu:0,cpu:1,cpu:2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("on [cpu(0), cpu(1)]"), last


def test_threads_above_the_core_count_warn_and_run(monkeypatch, capsys):
    import dlperf.cli.bench as bench_cli

    ran = []
    finished = SimpleNamespace(interrupted=False)
    monkeypatch.setattr(bench_cli, "_run_with_progress", lambda config: ran.append(config.threads) or finished)
    monkeypatch.setattr(bench_cli, "_emit", lambda result, args: None)
    many = cpu_count() + 1
    assert main(["bench", "--networks", "mlp", "--devices", "cpu", "--threads", f"1,{many}"]) == 0
    err = capsys.readouterr().err
    assert ran == [[1, many]]
    assert err.count("\n") == 1 and f"warning: --threads {many} is more than the {cpu_count()} cores" in err


def test_good_values_still_parse(scratch, monkeypatch):
    from dlperf.cli import build_parser

    args = build_parser().parse_args(_argv(_train("--lr", "0.5", "--seed", str(2**32 - 1), "--devices",
                                                  "cpu:0, cpu(1)"), scratch))
    assert args.lr == 0.5 and args.seed == 2**32 - 1 and [str(d) for d in args.devices] == ["cpu(0)", "cpu(1)"]
    args = build_parser().parse_args(["bench", "--threads", "1,2", "--networks", "LeNet,mlp", "--csv"])
    assert args.threads == [1, 2] and args.networks == ["LeNet", "mlp"] and args.csv == "-"
    doc = json.dumps({"traceEvents": [{"ph": "X", "ts": 0, "dur": 5, "pid": 1, "tid": 1}]})
    (scratch / "good_trace.json").write_text(doc)
    assert main(["trace", str(scratch / "good_trace.json")]) == 0


# --- files dlperf reads that name a plan, and paths that are not its files: the run goes on, with one line ---------
QUICK_TRAIN = ["train", "--plan", "auto", "--kvstore", "local", "--epochs", "1", "--train-size", "20", "--test-size",
               "10", "--batch-size", "10", "--no-progress"]  # (no process plans: their launches take seconds)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A plan cache holding the decision for QUICK_TRAIN, and a checkpoint of a run with a plan."""
    root = tmp_path_factory.mktemp("planned")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("DLPERF_PLAN_CACHE", str(root / "plans.json"))
        assert main(QUICK_TRAIN) == 0
        assert main([*QUICK_TRAIN[:2], "1x2", *QUICK_TRAIN[3:], "--checkpoint", str(root / "ck.pt")]) == 0
    finally:
        mp.undo()
    return root


def _cache_with(planned: Path, target: Path, change: dict) -> None:
    doc = json.loads((planned / "plans.json").read_text())
    (entry,) = doc["plans"].values()
    # reused as an uncontended decision, whatever the load was when the fixture planned: these tests are about
    # what a cached plan holds, and a contended one is never reused
    entry["contended"] = False
    for key, value in change.items():
        if key == "format":
            doc["format"] = value
        elif key in ("measured_ms", "alternatives"):
            entry[key] = value
        else:
            entry["plan"][key] = value
    target.write_text(json.dumps(doc))
    target.chmod(0o600)


CACHE_ENTRIES = [
    ({"threads": 1024}, "1024 threads for each replica, more than the"),
    ({"kvstore": "dist_sync"}, "kvstore dist_sync, a distributed store, which needs several processes"),
    ({"mixed_precision": "bf16"}, "bf16 mixed precision, which is planned for GPUs, on CPU devices"),
    ({"mixed_precision": "fp16"}, "fp16, which needs loss scaling"),
    ({"kvstore": "nosuch"}, "kvstore 'nosuch', not a store type here"),
    ({"replicas": 11, "threads": 1, "step_thread": "worker", "execution": "eager"},
     "11 replicas, more than the 10 examples of a batch"),
    ({"measured_ms": 5e-324}, "measured_ms is 4.94066e-324 ms, outside what any machine shows"),
    ({"format": True}, "not a format-1 plan cache"),
]


def _run_on(argv: list[str], capsys) -> tuple[str, list[str]]:
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return captured.out, captured.err.splitlines()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, named", CACHE_ENTRIES, ids=[str(c) for c, _ in CACHE_ENTRIES])
def test_a_cached_plan_that_cannot_run_here_is_one_line_and_the_run_plans_again(change, named, planned, tmp_path,
                                                                                 monkeypatch, capsys):
    cache = tmp_path / "plans.json"
    _cache_with(planned, cache, change)
    monkeypatch.setenv("DLPERF_PLAN_CACHE", str(cache))
    out, err = _run_on(QUICK_TRAIN, capsys)
    assert len(err) == 1 and str(cache) in err[0] and named in err[0], err
    assert "[cached from" not in out and "test acc:" in out.splitlines()[-1]


def test_names_in_a_cached_plan_reach_the_terminal_escaped(planned, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "plans.json"
    _cache_with(planned, cache, {"alternatives": [["\x1b[2J\nplan: forged", 5.0]]})
    monkeypatch.setenv("DLPERF_PLAN_CACHE", str(cache))
    out, err = _run_on(QUICK_TRAIN, capsys)
    assert err == [] and "[cached from" in out and "\x1b" not in out
    assert [ln for ln in out.splitlines() if ln.startswith("plan: forged")] == []


def _not_dlperfs(kind: str, root: Path):
    """A path that holds what dlperf did not write, and a check that it is as it was."""
    path = root / kind
    if kind == "fifo":
        os.mkfifo(path)
        return path, lambda: path.is_fifo()
    if kind == "link":
        (root / "victim").write_text("the user's")
        path.symlink_to(root / "victim")
        return path, lambda: path.is_symlink() and (root / "victim").read_text() == "the user's"
    if kind == "notes":
        path.write_text("my notes\n")
        return path, lambda: path.read_text() == "my notes\n"
    if os.geteuid() != 0:
        pytest.skip("a device node or a file of another user needs root to make")
    if kind == "char-device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null: only it can be harmed
        except OSError:
            pytest.skip("cannot create a device node here")
        return path, lambda: path.is_char_device()
    path.write_text('{"format": 1, "plans": {}}')
    os.chown(path, 54321, 54321)
    return path, lambda: path.read_text() == '{"format": 1, "plans": {}}' and path.stat().st_uid == 54321


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["char-device", "fifo", "link", "notes", "other-user"])
def test_a_plan_cache_path_that_is_not_dlperfs_file_is_left_alone(kind, tmp_path, monkeypatch, capsys):
    path, unharmed = _not_dlperfs(kind, tmp_path)
    monkeypatch.setenv("DLPERF_PLAN_CACHE", str(path))
    out, err = _run_on(QUICK_TRAIN, capsys)
    assert len(err) == 1 and str(path) in err[0] and "it is left as it is" in err[0], err
    assert unharmed() and "test acc:" in out.splitlines()[-1]
    assert sorted(os.listdir(tmp_path)) == sorted([kind] + (["victim"] if kind == "link" else []))


CHECKPOINT_PLANS = [
    ({"threads": 1024}, "1024 threads for each replica"),
    ({"kvstore": "dist_sync"}, "kvstore dist_sync, a distributed store, which needs several processes, in one"),
    ({"kvstore": None}, "kvstore None, but this run's state is laid out for local"),
    ({"mixed_precision": "bf16"}, "bf16 mixed precision, which is planned for GPUs"),
    ({"replicas": 64}, "64 replicas, more than the 10 examples of a batch"),
    ({"launcher": "processes", "threads": 1024}, "1024 threads for each replica"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, named", CHECKPOINT_PLANS, ids=[str(c) for c, _ in CHECKPOINT_PLANS])
def test_a_checkpoints_plan_that_cannot_run_here_is_one_line_and_the_run_resumes(change, named, planned, tmp_path,
                                                                                  monkeypatch, capsys):
    import torch

    from dlperf.parallel.training.checkpoint import state_checksum

    state = torch.load(planned / "ck.pt", weights_only=True)
    state["trainer"]["plan"].update(change)
    replicas = state["trainer"]["plan"]["replicas"]
    state["trainer"]["buffers"] = state["trainer"]["buffers"] * replicas  # as a run of that plan kept them
    state["checksum"] = state_checksum(state)  # crafted with care: only the plan can give it away
    torch.save(state, tmp_path / "ck.pt")
    monkeypatch.setenv("DLPERF_PLAN_CACHE", str(tmp_path / "plans.json"))
    argv = [*QUICK_TRAIN[:1], *QUICK_TRAIN[3:5], "--epochs", "2", *QUICK_TRAIN[7:], "--resume", str(tmp_path / "ck.pt")]
    out, err = _run_on(argv, capsys)
    assert len(err) == 1 and f"from the checkpoint {tmp_path / 'ck.pt'}: " in err[0] and named in err[0], err
    assert "epoch 2:" in out and "processes" not in out.splitlines()[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["weight", "history", "plan"])
def test_a_checkpoint_changed_after_it_was_written_is_one_line(where, planned, tmp_path, capsys):
    import torch

    state = torch.load(planned / "ck.pt", weights_only=True)
    if where == "weight":  # one bit of one stored float
        weight = next(iter(state["trainer"]["model"].values()))
        weight.view(torch.int32).view(-1)[0] ^= 1 << 3
    elif where == "history":
        state["history"][0]["loss"] = 0.001
    else:
        state["trainer"]["plan"]["threads"] = 1
    torch.save(state, tmp_path / "ck.pt")
    argv = [*QUICK_TRAIN[:1], *QUICK_TRAIN[3:5], "--epochs", "2", *QUICK_TRAIN[7:], "--resume", str(tmp_path / "ck.pt")]
    _check_one_line(main(argv), *capsys.readouterr(), "do not match the checksum written with them", tmp_path)
