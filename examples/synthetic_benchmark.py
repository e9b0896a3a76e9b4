"""Training throughput on random data: images per second per rank and in total.

    ringrun -np 2 python examples/synthetic_benchmark.py --model cnn
    ringrun -np 2 python examples/synthetic_benchmark.py --model mlp --fp16-allreduce

The same measurement as Horovod's pytorch_synthetic_benchmark.py, with the models of
examples/benchmark_models.py instead of torchvision's: after warm-up batches, each of
--num-iters iterations times --num-batches-per-iter training steps (forward, backward with
the gradients averaged over the ranks by DistributedOptimizer, optimizer step). Rank 0
prints each iteration's images/s, then the mean and 1.96 standard deviations (95 %).
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import ringmaster as rm
import benchmark_models  # examples/benchmark_models.py


def log(text):
    if rm.rank() == 0:
        print(text, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn", choices=sorted(benchmark_models.MODELS))
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="not timed")
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send the gradients as float16")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    rm.init()
    torch.set_num_threads(args.num_threads)

    model = benchmark_models.create(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * rm.size())
    compression = rm.Compression.fp16 if args.fp16_allreduce else rm.Compression.none
    optimizer = rm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        compression=compression)
    rm.broadcast_parameters(model.state_dict(), root_rank=0)
    rm.broadcast_optimizer_state(optimizer, root_rank=0)
    images, labels = benchmark_models.synthetic_batch(args.batch_size, seed=rm.rank())

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    log(f"Model: {args.model} ({benchmark_models.parameter_count(model) / 1e6:.1f} M parameters)")
    log(f"Batch size: {args.batch_size} per rank; {args.num_threads} torch thread(s) per rank")
    log(f"Number of ranks: {rm.size()}; gradients sent as {'float16' if args.fp16_allreduce else 'float32'}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    images_per_second = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        images_per_second.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{iteration}: {images_per_second[-1]:.1f} img/sec per rank")

    mean, confidence = np.mean(images_per_second), 1.96 * np.std(images_per_second)
    log(f"Img/sec per rank: {mean:.1f} +-{confidence:.1f}")
    log(f"Total img/sec on {rm.size()} rank(s): {rm.size() * mean:.1f} +-{rm.size() * confidence:.1f}")
    rm.shutdown()


if __name__ == "__main__":
    main()
