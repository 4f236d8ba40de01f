"""`make bench`: the latency table on this machine, into bench_out/.

Preset gpu (the memory guide's 512x512, 50 DDIM steps) where torch sees CUDA, else preset cpu
(the same SD1.5 architecture scaled to minutes on a small CPU). Extra arguments go to
bench.latency, e.g. `python -m bench.run --model /path/to/sd15 --rows original,fp16`.
"""
import sys


def main(argv=None):
    import torch

    from bench import latency

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--preset" not in argv:
        argv += ["--preset", "gpu" if torch.cuda.is_available() else "cpu"]
    if "--out" not in argv:
        argv += ["--out", "bench_out"]
    return latency.main(argv)


if __name__ == "__main__":
    main()
