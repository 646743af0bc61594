"""`hybridgnn train`: train GraphSAGE, GCN or GAT on a labelled dataset."""

from __future__ import annotations

import json

from hybridgnn.cli.flags import DefaultsHelpFormatter, user_path
from hybridgnn.cli.outputs import check_out, staged_directory

FORCE_HELP = "replace --out when it already holds something (once the new model directory is whole)"


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model on a labelled dataset",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--dataset", type=user_path, required=True, help="dataset directory")
    p.add_argument("--out", type=user_path, required=True, help="model directory to write")
    p.add_argument("--kind", choices=["sage", "gcn", "gat"], default="sage", help="model layers")
    p.add_argument("--hidden-dim", type=int, default=64, help="hidden width")
    p.add_argument("--num-layers", type=int, default=2, help="layers (one hop each)")
    p.add_argument("--heads", type=int, default=4, help="GAT attention heads")
    p.add_argument("--dropout", type=float, default=0.3, help="dropout while training")
    p.add_argument("--fanouts", default="10,5", help="neighbours sampled per hop, hop 1 first (saved with the model)")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training nodes")
    p.add_argument("--batch-size", type=int, default=512, help="seeds per training batch")
    p.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.set_defaults(run=run)


def run(args) -> int:
    from hybridgnn.config import parse_fanouts
    from hybridgnn.graph.store import GraphStore
    from hybridgnn.models.checkpoint import save_checkpoint
    from hybridgnn.models.train import TrainConfig, train

    cfg = TrainConfig(kind=args.kind, hidden_dim=args.hidden_dim, num_layers=args.num_layers, heads=args.heads,
                      dropout=args.dropout, fanouts=parse_fanouts(args.fanouts), epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    check_out(args.out, directory=True, staged=True, force=args.force)  # before training, not after it
    graph = GraphStore.open(args.dataset)
    model, metrics = train(graph, cfg)
    with staged_directory(args.out, "training") as staging:  # moved in whole: never half a model at --out
        save_checkpoint(model, staging, extra={"dataset_fingerprint": graph.fingerprint,
                                               "fanouts": list(cfg.fanouts), "metrics": metrics})
    print(json.dumps({"model": str(args.out), "val_acc": metrics["val_acc"], "test_acc": metrics["test_acc"],
                      "train_s": round(metrics["train_s"], 2)}, indent=2))
    return 0
