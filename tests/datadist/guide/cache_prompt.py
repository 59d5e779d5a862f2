"""The guide's ordinary-cache sample (功能示例（一般Cache传输场景）), P side, as a program.

The guide's code in its order, with only the import lines changed (CPU in
place of NPU, ``kvfunc.datadist`` in place of ``llm_datadist``).  What the
guide leaves to the user (settings, the model, how the decoder's addresses
and the go-aheads travel, the keys a step names, checks) comes from
``user``; each such line ends with ``# user``.  The guide's shape is "only
an example"; the P cache holds the 8 entries its 8 keys name.
"""

if __name__ != "__main__":  # pytest's doctest run imports every file: this is a program
    import pytest

    pytest.skip("a program that test_guide_samples.py runs", allow_module_level=True)

from typing import Optional

from npu_on_cpu import (  # was: import torchair; import torch
    torch,
    torch_npu,  # noqa: F401  (was: import torch_npu)
    torchair,
)
from user import (  # user
    DECODER_CLUSTER_ID,
    DEVICE_ID,
    MODE,
    POOL_BYTES,
    PROMPT_CLUSTER_ID,
    PROMPT_IP,
    PROMPT_PORT,
    get,
    put,
    user_model,
)

from kvfunc.datadist import (  # was: from llm_datadist import ...
    CacheDesc,
    CacheKey,
    DataType,
    LayerSynchronizer,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    TransferConfig,
)

# 链路管理: initialise; the prompt side listens
llm_datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
llm_config = LLMConfig()
llm_config.device_id = DEVICE_ID
llm_config.listen_ip_info = f"{PROMPT_IP}:{PROMPT_PORT}"
llm_config.ge_options = {"ge.flowGraphMemMaxSize": POOL_BYTES}
llm_datadist.init(llm_config.generate_options())

# step 2
kv_cache_manager = llm_datadist.kv_cache_manager
cache_desc = CacheDesc(num_tensors=4, shape=[8, 4, 8], data_type=DataType.DT_FLOAT16)
batch_num = 8
kv_cache = kv_cache_manager.allocate_cache(cache_desc, [CacheKey(prompt_cluster_id=0, req_id=i, model_id=0) for i in range(batch_num)])  # noqa: E501
kv_tensor_addrs = kv_cache.per_device_tensor_addrs[0]
kv_tensors = torchair.llm_datadist.create_npu_tensors(kv_cache.cache_desc.shape, torch.float16, kv_tensor_addrs)  # noqa: E501

if MODE == "pull":  # user: step 4, first way (the decoder pulls)
    user_model.Predict(kv_tensors)  # user
    put("p_ready", True)  # user
    get("d_done")  # user
else:  # user: step 4, second way
    decoder_kv_cache_addrs = get("d_addrs")  # user

    class LayerSynchronizerImpl(LayerSynchronizer):
        def __init__(self, events):
            self._events = events

        def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:  # noqa: UP045
            self._events[layer_index].wait()
            return True

    events = [torch.npu.Event() for _ in range(cache_desc.num_tensors // 2)]
    user_model.Predict(kv_tensors, events)
    transfer_config = TransferConfig(DECODER_CLUSTER_ID, decoder_kv_cache_addrs)
    cache_task = kv_cache_manager.transfer_cache_async(kv_cache, LayerSynchronizerImpl(events), [transfer_config])  # noqa: E501
    cache_task.synchronize()
    put("p_done", True)  # user
    get("d_done")  # user

# step 6
cache_key_0 = CacheKey(prompt_cluster_id=0, req_id=0, model_id=0)  # user
cache_key_2 = CacheKey(prompt_cluster_id=0, req_id=2, model_id=0)  # user
kv_cache_manager.remove_cache_key(cache_key_0)
kv_cache_manager.remove_cache_key(cache_key_2)
kv_cache_manager.deallocate_cache(kv_cache)
held = len(kv_cache_manager.state.bindings)  # user: keys that still hold the cache
assert held == (5 if MODE == "pull" else 6), held  # user: a pull released key 1

# step 7: the decoder unlinks; finalize
get("d_unlinked")  # user
llm_datadist.finalize()
