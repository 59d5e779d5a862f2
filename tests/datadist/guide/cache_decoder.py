"""The guide's ordinary-cache sample (功能示例（一般Cache传输场景）), D side, as a program.

The guide's code in its order, with only the import lines changed (CPU in
place of NPU, ``kvfunc.datadist`` in place of ``llm_datadist``); lines
ending with ``# user`` are what the guide leaves to the user, including the
check that the right entry arrived.
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
    CacheDesc,
    CacheKey,
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

# step 3
kv_cache_manager = llm_datadist.kv_cache_manager
cache_desc = CacheDesc(num_tensors=4, shape=[4, 4, 8], data_type=DataType.DT_FLOAT16)
kv_cache = kv_cache_manager.allocate_cache(cache_desc)

if MODE == "pull":  # user: step 4, first way
    get("p_ready")  # user
    cache_key = CacheKey(prompt_cluster_id=0, req_id=1, model_id=0)
    kv_cache_manager.pull_cache(cache_key, kv_cache, batch_index=1)
else:  # user: step 4, second way: the prompt side pushes into these addresses
    put("d_addrs", kv_cache.per_device_tensor_addrs[0])  # user
    get("p_done")  # user

# step 5
kv_tensor_addrs = kv_cache.per_device_tensor_addrs[0]
kv_tensors = torchair.llm_datadist.create_npu_tensors(kv_cache.cache_desc.shape, torch.float16, kv_tensor_addrs)  # noqa: E501
mid = len(kv_tensors) // 2
k_tensors = kv_tensors[: mid]
v_tensors = kv_tensors[mid:]
kv_cache_tensors = list(zip(k_tensors, v_tensors))  # noqa: B905
entry = 1 if MODE == "pull" else 0  # user: a pull fills entry 1, the push entry 0
for i, tensor in enumerate(kv_tensors):  # user: the prompt's entry arrived, whole
    assert torch.equal(tensor[entry], expected([8, 4, 8], i)[entry]), i
put("d_done", True)  # user

# step 6
kv_cache_manager.deallocate_cache(kv_cache)

# step 7
ret, rets = llm_datadist.unlink_clusters([cluster], 5000)
assert ret == LLMStatusCode.LLM_SUCCESS, ret  # user
put("d_unlinked", True)  # user
llm_datadist.finalize()
