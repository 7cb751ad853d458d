# The job behind tests/data/recorded_job/ (one DTensor rank on gloo), recorded with
#   python -m sharddbg.cli record --out tests/data/recorded_job -- python tests/data/recorded_job_script.py
import os, torch, torch.distributed as dist
from torch.distributed.tensor import distribute_tensor, init_device_mesh, Replicate
os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29617')
dist.init_process_group('gloo', rank=0, world_size=1)
x = distribute_tensor(torch.randn(4, 4), init_device_mesh('cpu', (1,)), [Replicate()])
for i in range(3):
    x = torch.relu(x @ x.T) / 4
dist.all_reduce(x.to_local())
print('done', float(x.full_tensor().sum()) >= 0)
dist.destroy_process_group()
