"""Published figures: Shi et al. (2016), "Benchmarking State-of-the-Art Deep Learning Software Tools", Table 7.

Seconds per mini-batch. Desktop CPU is an Intel i7-3820 (4 cores, 8 threads), server CPU two Xeon
E5-2630v3 (16 cores, 32 threads); GPUs are a GTX 980, a GTX 1080 and one GK210 of a Tesla K80.
``None`` is the paper's "-" (the tool could not run that configuration). Batch sizes were Table 9's
on CPUs and those in the note under Table 7 on GPUs, which :mod:`dlperf.models` uses by default.
"""

from __future__ import annotations

from dataclasses import dataclass

FRAMEWORKS = ("Caffe", "CNTK", "TF", "MXNet", "Torch")

# Column layout of every row below.
DESKTOP_THREADS = (1, 2, 4, 8)
SERVER_THREADS = (1, 2, 4, 8, 16, 32)
GPUS = ("G980", "G1080", "K80")

_: None = None  # a cell the paper leaves empty
# network -> framework -> 4 desktop-CPU + 6 server-CPU + 3 GPU figures
TABLE7: dict[str, dict[str, tuple[float | None, ...]]] = {
    "fcn-s": {
        "Caffe": (1.324, 0.790, 0.578, 15.444, 1.355, 0.997, 0.745, 0.573, 0.608, 1.130, 0.041, 0.030, 0.071),
        "CNTK": (1.227, 0.660, 0.435, _, 1.340, 0.909, 0.634, 0.488, 0.441, 1.000, 0.045, 0.033, 0.074),
        "TF": (7.062, 4.789, 2.648, 1.938, 9.571, 6.569, 3.399, 1.710, 0.946, 0.630, 0.060, 0.048, 0.109),
        "MXNet": (4.621, 2.607, 2.162, 1.831, 5.824, 3.356, 2.395, 2.040, 1.945, 2.670, _, 0.106, 0.216),
        "Torch": (1.329, 0.710, 0.423, _, 1.279, 1.131, 0.595, 0.433, 0.382, 1.034, 0.040, 0.031, 0.070),
    },
    "alexnet-s": {
        "Caffe": (1.606, 0.999, 0.719, _, 1.533, 1.045, 0.797, 0.850, 0.903, 1.124, 0.034, 0.021, 0.073),
        "CNTK": (3.761, 1.974, 1.276, _, 3.852, 2.600, 1.567, 1.347, 1.168, 1.579, 0.045, 0.032, 0.091),
        "TF": (6.525, 2.936, 1.749, 1.535, 5.741, 4.216, 2.202, 1.160, 0.701, 0.962, 0.059, 0.042, 0.130),
        "MXNet": (2.977, 2.340, 2.250, 2.163, 3.518, 3.203, 2.926, 2.828, 2.827, 2.887, 0.020, 0.014, 0.042),
        "Torch": (4.645, 2.429, 1.424, _, 4.336, 2.468, 1.543, 1.248, 1.090, 1.214, 0.033, 0.023, 0.070),
    },
    "resnet-50": {
        "Caffe": (11.554, 7.671, 5.652, _, 10.643, 8.600, 6.723, 6.019, 6.654, 8.220, _, 0.254, 0.766),
        "CNTK": (_, _, _, _, _, _, _, _, _, _, 0.240, 0.168, 0.638),
        "TF": (23.905, 16.435, 10.206, 7.816, 29.960, 21.846, 11.512, 6.294, 4.130, 4.351, 0.327, 0.227, 0.702),
        "MXNet": (48.000, 46.154, 44.444, 43.243, 57.831, 57.143, 54.545, 54.545, 53.333, 55.172,
                  0.207, 0.136, 0.449),
        "Torch": (13.178, 7.500, 4.736, 4.948, 12.807, 8.391, 5.471, 4.164, 3.683, 4.422, 0.208, 0.144, 0.523),
    },
    "fcn-r": {
        "Caffe": (2.476, 1.499, 1.149, _, 2.282, 1.748, 1.403, 1.211, 1.127, 1.127, 0.025, 0.017, 0.055),
        "CNTK": (1.845, 0.970, 0.661, 0.571, 1.592, 0.857, 0.501, 0.323, 0.252, 0.280, 0.025, 0.017, 0.053),
        "TF": (2.647, 1.913, 1.157, 0.919, 3.410, 2.541, 1.297, 0.661, 0.361, 0.325, 0.033, 0.020, 0.063),
        "MXNet": (1.914, 1.072, 0.719, 0.702, 1.609, 1.065, 0.731, 0.534, 0.451, 0.447, 0.029, 0.019, 0.060),
        "Torch": (1.670, 0.926, 0.565, 0.611, 1.379, 0.915, 0.662, 0.440, 0.402, 0.366, 0.025, 0.016, 0.051),
    },
    "alexnet-r": {
        "Caffe": (3.558, 2.587, 2.157, 2.963, 4.270, 3.514, 3.381, 3.364, 4.139, 4.930, 0.041, 0.027, 0.137),
        "CNTK": (9.956, 7.263, 5.519, 6.015, 9.381, 6.078, 4.984, 4.765, 6.256, 6.199, 0.045, 0.031, 0.108),
        "TF": (4.535, 3.225, 1.911, 1.565, 6.124, 4.229, 2.200, 1.396, 1.036, 0.971, 0.227, 0.317, 0.385),
        "MXNet": (13.401, 12.305, 12.278, 11.950, 17.994, 17.128, 16.764, 16.471, 17.471, 17.770,
                  0.060, 0.032, 0.122),
        "Torch": (5.352, 3.866, 3.162, 3.259, 6.554, 5.288, 4.365, 3.940, 4.157, 4.165, 0.069, 0.043, 0.141),
    },
    "resnet-56": {
        "Caffe": (6.741, 5.451, 4.989, 6.691, 7.513, 6.119, 6.232, 6.689, 7.313, 9.302, _, 0.116, 0.378),
        "CNTK": (_, _, _, _, _, _, _, _, _, _, 0.206, 0.138, 0.562),
        "TF": (_, _, _, _, _, _, _, _, _, _, 0.225, 0.152, 0.523),
        "MXNet": (34.409, 31.255, 30.069, 31.388, 44.878, 43.775, 42.299, 42.965, 43.854, 44.367,
                  0.105, 0.074, 0.270),
        "Torch": (5.758, 3.222, 2.368, 2.475, 8.691, 4.965, 3.040, 2.560, 2.575, 2.811, 0.150, 0.101, 0.301),
    },
    "lstm": {
        "Caffe": (_, _, _, _, _, _, _, _, _, _, _, _, _),
        "CNTK": (0.186, 0.120, 0.090, 0.118, 0.211, 0.139, 0.117, 0.114, 0.114, 0.198, 0.018, 0.017, 0.043),
        "TF": (4.662, 3.385, 1.935, 1.532, 6.449, 4.351, 2.238, 1.183, 0.702, 0.598, 0.133, 0.065, 0.140),
        "MXNet": (_, _, _, _, _, _, _, _, _, _, 0.089, 0.079, 0.149),
        "Torch": (6.921, 3.831, 2.682, 3.127, 7.471, 4.641, 3.580, 3.260, 5.148, 5.851, 0.399, 0.324, 0.560),
    },
}
del _


@dataclass(frozen=True)
class PaperFigure:
    """What the paper reports for one network on one platform column."""

    column: str  # e.g. "desktop CPU, 2 threads" or "GTX 1080"
    torch_s: float | None
    best_s: float | None
    best_framework: str | None


def _column_index(device_kind: str, threads: int | None) -> tuple[int, str] | None:
    if device_kind == "gpu":
        return len(DESKTOP_THREADS) + len(SERVER_THREADS) + GPUS.index("G1080"), "GTX 1080"
    if threads in DESKTOP_THREADS:
        return DESKTOP_THREADS.index(threads), f"desktop CPU, {threads} thread{'s' if threads > 1 else ''}"
    return None


def paper_figure(network: str, device_kind: str, threads: int | None) -> PaperFigure | None:
    """The paper's Torch figure and its best tool for the matching column, if the paper has one.

    CPU cells compare with the desktop i7-3820 at the same thread count (a desktop is what most
    readers have); GPU cells with the GTX 1080, the paper's fastest GPU.

    >>> paper_figure("fcn-r", "cpu", 1)
    PaperFigure(column='desktop CPU, 1 thread', torch_s=1.67, best_s=1.67, best_framework='Torch')
    """
    rows = TABLE7.get(network)
    col = _column_index(device_kind, threads)
    if rows is None or col is None:
        return None
    idx, label = col
    values: dict[str, float] = {fw: v for fw in FRAMEWORKS if (v := rows[fw][idx]) is not None}
    best_fw = min(values, key=values.__getitem__) if values else None
    return PaperFigure(label, rows["Torch"][idx], values.get(best_fw) if best_fw else None, best_fw)
