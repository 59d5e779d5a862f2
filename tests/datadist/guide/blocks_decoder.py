"""The guide's blocks-cache sample (功能示例（Blocks Cache传输场景）), D side, as a program.

The guide's code in its order, with only the import lines changed (CPU in
place of NPU, ``kvfunc.datadist`` in place of ``llm_datadist``); lines
ending with ``# user`` are what the guide leaves to the user (its pull
step names the cache ``cache``, which its step 2 calls ``kv_cache``),
including the check that the right blocks arrived.
"""

if __name__ != "__main__":  # pytest's doctest run imports every file: this is a program
    import pytest

    pytest.skip("a program that test_guide_samples.py runs", allow_module_level=True)

from npu_on_cpu import (  # was: import torchair; import torch
    torch,
    torch_npu,  # noqa: F401  (was: import torch_npu)
    torchair,
)
from user import (  # user
    DECODER_CLUSTER_ID,
    DECODER_IP,
    DEVICE_ID,
    MODE,
    POOL_BYTES,
    PROMPT_CLUSTER_ID,
    PROMPT_IP,
    PROMPT_PORT,
    expected,
    get,
    put,
)

from kvfunc.datadist import (  # was: from llm_datadist import ...
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

# 链路管理: initialise, then link to the prompt cluster
llm_datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER_ID)
llm_config = LLMConfig()
llm_config.device_id = DEVICE_ID
llm_config.ge_options = {"ge.flowGraphMemMaxSize": POOL_BYTES}
llm_datadist.init(llm_config.generate_options())
cluster = LLMClusterInfo()
cluster.remote_cluster_id = PROMPT_CLUSTER_ID
cluster.append_local_ip_info(DECODER_IP, 26000)
cluster.append_remote_ip_info(PROMPT_IP, PROMPT_PORT)
ret, rets = llm_datadist.link_clusters([cluster], 5000)
if ret != LLMStatusCode.LLM_SUCCESS:
    raise Exception("link failed.")

# step 2, D side
kv_cache_manager = llm_datadist.kv_cache_manager
num_blocks = 10
block_mem_size = 128
cache_desc = CacheDesc(num_tensors=4, shape=[10, 128], data_type=DataType.DT_FLOAT16)
kv_cache = kv_cache_manager.allocate_blocks_cache(cache_desc)
kv_tensor_addrs = kv_cache.per_device_tensor_addrs[0]
kv_tensors = torchair.llm_datadist.create_npu_tensors(kv_cache.cache_desc.shape, torch.float16, kv_tensor_addrs)  # noqa: E501
for tensor in kv_tensors:  # user: start from zeros, to see what arrives where
    tensor.zero_()

if MODE == "pull":  # user: step 4, first way
    get("p_ready")  # user
    cache = kv_cache  # user
    cache_key = BlocksCacheKey(prompt_cluster_id=0, model_id=0)  # P侧allocate_blocks_cache时的入参
    kv_cache_manager.pull_blocks(cache_key, cache, [0, 1], [2, 3])  # 将P侧0, 1 block位置上的数据拉到D侧2, 3 block位置上  # noqa: E501
else:  # user: step 4, second way: the prompt side pushes into these addresses
    put("d_addrs", kv_tensor_addrs)  # user
    get("p_done")  # user

for i, tensor in enumerate(kv_tensors):  # user: P's blocks 0, 1 are D's 2, 3; no other
    assert torch.equal(tensor[[2, 3]], expected([10, 128], i)[[0, 1]]), i
    assert 0 == int(tensor[[0, 1, 4, 5, 6, 7, 8, 9]].count_nonzero()), i
put("d_done", True)  # user

# step 5
kv_cache_manager.deallocate_cache(kv_cache)

# step 6
ret, rets = llm_datadist.unlink_clusters([cluster], 5000)
assert ret == LLMStatusCode.LLM_SUCCESS, ret  # user
put("d_unlinked", True)  # user
llm_datadist.finalize()
