"""A deep residual MLP as an ``nn.Sequential``, for pipeline parallelism (``--pp``): 16 blocks
of width 2048 and a 1000-way head, split into stages by its children.

    memsim analyze examples/pipeline_mlp.py:model --input input=float32[B,2048] --at B=64 \
        --pp 4 --pp-schedule 1F1B --microbatches 8
"""

from torch import nn


class Block(nn.Module):
    """``x + fc2(gelu(fc1(x)))``, ``fc1`` four times as wide."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.GELU(), \
            nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def model(blocks: int = 16, width: int = 2048, classes: int = 1000) -> nn.Sequential:
    return nn.Sequential(*[Block(width) for _ in range(blocks)], nn.Linear(width, classes))
