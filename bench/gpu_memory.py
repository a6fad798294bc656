"""What one GPU offers a trainer process: the figure --gpu-memory-gib's default comes from (launch/memory_plan.py).

    torch.cuda.get_device_properties(0).total_memory   the card's memory as CUDA reports it (the plan's total, whose
                                                        reserve holds the CUDA context, is compared with this)
    torch.cuda.mem_get_info() after the context is up  what is left once torch's context and cuBLAS are loaded
    256 MiB blocks allocated to the first out-of-memory what torch's caching allocator can actually hold

Prints one table row per GPU measure, in bytes and GiB; needs a CUDA GPU (one line and exit status 1 without).

    python bench/gpu_memory.py
"""

import subprocess
import sys

GIB = 2**30
BLOCK = 256 * 2**20


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_memory.py: no CUDA GPU is visible to this python: run it on a machine with one", file=sys.stderr)
        return 1
    total = torch.cuda.get_device_properties(0).total_memory
    matrix = torch.ones(64, 64, device="cuda")
    matrix @ matrix  # cuBLAS's workspace, as a training step has it
    free_after_context, _ = torch.cuda.mem_get_info()
    blocks = []
    try:
        while True:
            blocks.append(torch.empty(BLOCK, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        pass
    allocatable = len(blocks) * BLOCK
    del blocks
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.reserved,driver_version",
                          "--format=csv,noheader", "--id=0"], capture_output=True, text=True).stdout.strip()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, nvidia-smi: {smi or 'not found'}")
    print(f"| {'measure':50s} | {'bytes':>15s} | {'GiB':>7s} |")
    print(f"|{'-' * 52}|{'-' * 17}|{'-' * 9}|")
    for name, value in (("total memory (CUDA)", total), ("free once torch's context is up", free_after_context),
                        ("allocatable by torch, 256 MiB blocks", allocatable)):
        print(f"| {name:50s} | {value:15,d} | {value / GIB:7.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
