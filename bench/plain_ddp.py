"""The baseline for bench/overhead: a plain torch DDP training loop, as in PyTorch's DDP tutorial.

Same model (timm), data, batch, optimizer and seed as our loop; stock DDP defaults; no metrics, no hooks.
"""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from data.common import build_data
from models.factory import create_model


@record
def plain_worker(cfg: dict, out_path: str) -> None:
    torch.set_num_threads(cfg["trainer"]["threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["trainer"]["seed"])
    data = build_data(cfg["data"])
    model = DistributedDataParallel(create_model(cfg["model"]["name"], data.num_classes))
    opt = torch.optim.SGD(
        model.parameters(),
        lr=cfg["optimizer"]["lr"],
        momentum=cfg["optimizer"]["momentum"],
        weight_decay=cfg["optimizer"]["weight_decay"],
    )
    batch = cfg["data"]["batch_size"]
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=cfg["trainer"]["seed"])
    loader = DataLoader(data.train, batch_size=batch, sampler=sampler, drop_last=True)
    criterion = torch.nn.CrossEntropyLoss()
    step_s = []
    max_steps = cfg["trainer"]["max_steps"]
    epoch = 0
    tick = time.perf_counter()
    while len(step_s) < max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()
            loss.item()
            now = time.perf_counter()
            step_s.append(now - tick)
            tick = now
            if len(step_s) >= max_steps:
                break
        epoch += 1
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"step_s": step_s, "samples_per_step": batch * world}, f)
    dist.destroy_process_group()
