"""A user's reproduction, as they would write it: ZeRO-2 with gradient accumulation against plain PyTorch.

Exit 1 if DeepSpeed's parameters differ from plain PyTorch's (the bug), 0 if they match. Plain
DeepSpeed and torch only (no Fixbook code): `fixbook bisect` runs it once per release.
"""
import os
import socket
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")

import deepspeed  # noqa: E402
import torch  # noqa: E402

# CPU only: DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce op (minutes of
# C++ on a small machine) in init_distributed; one process needs no all-reduce.
import deepspeed.comm.torch  # noqa: E402,F401
if hasattr(sys.modules["deepspeed.comm.torch"], "build_shm_op"):
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

deepspeed.init_distributed(dist_backend="gloo", verbose=False)
GAS, STEPS, LR = 2, 2, 0.1


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(GAS)] for _ in range(STEPS)]


config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
net = model()
engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), config=config)
for step in batches():
    for x, y in step:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()

reference = model()
optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
for step in batches():
    optimizer.zero_grad()
    for x, y in step:
        (torch.nn.functional.mse_loss(reference(x), y) / GAS).backward()
    optimizer.step()

same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(engine.module.parameters(), reference.parameters()))
print("matches plain PyTorch" if same else "differs from plain PyTorch")
sys.exit(0 if same else 1)
