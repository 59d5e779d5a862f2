"""The guide's blocks-cache sample (功能示例（Blocks Cache传输场景）), P side, as a program.

The guide's code in its order, with only the import lines changed (CPU in
place of NPU, ``kvfunc.datadist`` in place of ``llm_datadist``); lines
ending with ``# user`` are what the guide leaves to the user (the push
step names the model's tensors ``kv_cache_tensors``, which the guide's
step 2 calls ``kv_tensors``).
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
    BlocksCacheKey,
    CacheDesc,
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

# step 2, P side
kv_cache_manager = llm_datadist.kv_cache_manager
num_blocks = 10
block_mem_size = 128
cache_desc = CacheDesc(num_tensors=4, shape=[num_blocks, block_mem_size], data_type=DataType.DT_FLOAT16)  # noqa: E501
cache_key = BlocksCacheKey(prompt_cluster_id=0, model_id=0)
kv_cache = kv_cache_manager.allocate_blocks_cache(cache_desc, cache_key)
kv_tensor_addrs = kv_cache.per_device_tensor_addrs[0]
kv_tensors = torchair.llm_datadist.create_npu_tensors(kv_cache.cache_desc.shape, torch.float16, kv_tensor_addrs)  # noqa: E501

if MODE == "pull":  # user: step 4, first way (the decoder pulls)
    user_model.Predict(kv_tensors)  # user
    put("p_ready", True)  # user
    get("d_done")  # user
else:  # user: step 4, second way
    decoder_kv_cache_addrs = get("d_addrs")  # user
    kv_cache_tensors = kv_tensors  # user

    class LayerSynchronizerImpl(LayerSynchronizer):
        def __init__(self, events):
            self._events = events

        def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:  # noqa: UP045
            self._events[layer_index].wait()
            return True

    events = [torch.npu.Event() for _ in range(cache_desc.num_tensors // 2)]
    user_model.Predict(kv_cache_tensors, events)
    transfer_config = TransferConfig(DECODER_CLUSTER_ID, decoder_kv_cache_addrs)
    cache_task = kv_cache_manager.transfer_cache_async(kv_cache, LayerSynchronizerImpl(events), [transfer_config], [0, 1], [2, 3])  # noqa: E501
    cache_task.synchronize()
    put("p_done", True)  # user
    get("d_done")  # user

# step 5
kv_cache_manager.deallocate_cache(kv_cache)
assert not kv_cache_manager.state.caches  # user: released, no pin left

# step 6: the decoder unlinks; finalize
get("d_unlinked")  # user
llm_datadist.finalize()
