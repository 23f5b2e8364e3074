"""A training script written against the CAC relaxed-sync API, steps 1-8 of its usage guide, on CPU.

    .venv/bin/torchrun --standalone --nproc-per-node 3 examples/relaxed_sync_cac.py \
        --epochs 4 --simulate-slow-process 1 --sleep-process-start-epoch 2

Epochs count from 1, as everywhere in relaxsync. The last rank is slowed from epoch 2; at the start of epoch 3 it
is evicted (it exits with status 0) and the other two finish the run. Data: scikit-learn's digits; model: timm's
test_resnet.
"""

from __future__ import annotations

import argparse
import os
import sys

import timm
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# 1) Import RelaxedSyncDistributedDataParallel as DDP.
from compat.cac import RelaxedSyncDistributedDataParallel as DDP  # noqa: E402
from data.digits import load_tensors  # noqa: E402


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1, 5)) -> list[torch.Tensor]:
    pred = output.topk(max(topk), dim=1).indices
    hits = pred.eq(target.unsqueeze(1))
    return [hits[:, :k].any(dim=1).float().mean() * 100.0 for k in topk]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--model", default="test_resnet")
    parser.add_argument("--relaxed-sync-threshold", type=float, default=2.0)
    parser.add_argument("--relaxed-sync-mode-threshold", type=float, default=0.8)
    parser.add_argument("--simulate-slow-process", type=int, default=0)
    parser.add_argument("--sleep-process-start-epoch", type=int, default=10, help="the first slowed epoch (from 1)")
    parser.add_argument("--sleep-time", type=float, default=0.0, help="seconds; 0 = 30 x the mean forward time")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x_train, y_train, x_val, y_val = load_tensors(image_size=32)
    train_dataset, val_dataset = TensorDataset(x_train, y_train), TensorDataset(x_val, y_val)
    model = timm.create_model(args.model, num_classes=10)

    # 2) Wrap the model, setting the relaxed-sync thresholds.
    model = DDP(
        model,
        relaxed_sync_threshold=args.relaxed_sync_threshold,
        relaxed_sync_mode_threshold=args.relaxed_sync_mode_threshold,
        simulate_slow_process=args.simulate_slow_process,
        sleep_process_start_epoch=args.sleep_process_start_epoch,
        sleep_time=args.sleep_time,
        master_skip=True,  # rank 0 may be evicted too (torchrun keeps the store in its agent)
    )
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    # 3) Train and val loaders from the model.
    train_sampler = None
    train_loader = model.TrainDataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=0, pin_memory=False, sampler=train_sampler, collate_fn=None)  # fmt: skip
    val_loader = model.ValDataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=0, pin_memory=False, sampler=None, collate_fn=None)  # fmt: skip

    min_num_processes = world_size / 2
    for epoch in range(1, args.epochs + 1):
        # 5) At each epoch start: find slow processes and drop them from the group.
        model.set_relaxed_pg(epoch, min_num_processes=min_num_processes)
        # 6) Rearrange the loaders when the number of processes changed.
        train_loader, val_loader = model.rearrage_data_loaders(train_loader, val_loader)
        # 7) Coordinate the learning rate with the number of processes.
        lr = model.adjust_lr_by_procs(args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr

        model.train()
        for images, target in train_loader:
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # 4) Loss averaged over the active processes.
            reduced_loss = model.calc_reduced_tensor(loss.data)

        model.eval()
        totals, seen = torch.zeros(3), 0
        with torch.no_grad():
            for images, target in val_loader:
                output = model(images)
                prec1, prec5 = accuracy(output, target)
                totals += torch.tensor([criterion(output, target).item(), prec1.item(), prec5.item()]) * len(target)
                seen += len(target)
        # 4) loss, prec@1 and prec@5 averaged over the active processes.
        val_loss, prec1, prec5 = model.calc_prec(*(totals / seen))
        if dist.get_rank(model.membership.group) == 0:
            print(
                f"epoch {epoch}: processes {model.membership.size}, lr {lr:.4f}, train loss {reduced_loss.item():.4f}, "
                f"val loss {val_loss.item():.4f}, prec@1 {prec1.item():.2f}, prec@5 {prec5.item():.2f}",
                flush=True,
            )

    # 8) Before returning from main.
    model.finalize()
    if rank == model.membership.logging_rank:
        print(f"done: {model.membership.size} of {world_size} processes finished", flush=True)


if __name__ == "__main__":
    main()
