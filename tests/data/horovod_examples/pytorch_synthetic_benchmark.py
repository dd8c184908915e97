# ruff: noqa  (upstream code, kept as upstream wrote it: only the changes listed below are ours)
# Horovod's PyTorch synthetic benchmark, adapted only where this machine forces it.
# Source: horovod/horovod@2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a:examples/pytorch/pytorch_synthetic_benchmark.py
# (Apache-2.0). Every hvd call (DistributedOptimizer before broadcast_parameters / broadcast_optimizer_state, as
# upstream orders them), the fixed fake batch and the timeit loop are upstream's. The test runs this file under
# real Horovod and a copy whose one line `import horovod.torch as hvd` becomes `import unidist.compat.horovod as hvd`.
# Changes:
# (2) no torchvision.models: --model defaults to tiny_resnet, harness.models.tiny_resnet (a hand-built residual
#     network with batch norm; the script still calls getattr(models, args.model)()).
# (4) seconds, not minutes, on two shared cores: 3x32x32 fake images (upstream 3x224x224), --batch-size 16
#     (upstream 32), 2 warm-up batches and 3 iterations of 3 batches (upstream 10, 10 of 10).
# (6) test harness: --out DIR saves each rank's final weights and printed lines (the img/sec figures are timings
#     and are not compared).
# (7) test harness: torch.manual_seed(--seed) after hvd.init(). Upstream draws the fake batch and the model's
#     initial weights unseeded, so two runs could not be compared; the seed is the same on every rank, as in the
#     MNIST example.
import argparse
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from harness import models, record_stdout, save_run  # (2) (6)
import horovod.torch as hvd
import timeit
import numpy as np

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')

parser.add_argument('--model', type=str, default='tiny_resnet',  # (2)
                    help='model to benchmark')
parser.add_argument('--batch-size', type=int, default=16,  # (4)
                    help='input batch size')

parser.add_argument('--num-warmup-batches', type=int, default=2,  # (4)
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=3,  # (4)
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=3,  # (4)
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')

parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')

parser.add_argument('--seed', type=int, default=42, help='test harness: seed the fake data')  # (7)
parser.add_argument('--out', help='test harness: save each rank\'s final weights and printed lines here')  # (6)

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()
if args.out:
    record_stdout()  # (6)

hvd.init()
torch.manual_seed(args.seed)  # (7)

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up standard model.
model = getattr(models, args.model)()

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()
    # If using GPU Adasum allreduce, scale learning rate by local_size.
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, 32, 32)  # (4)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '')


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

save_run(args.out, hvd.rank(), model)  # (6)
