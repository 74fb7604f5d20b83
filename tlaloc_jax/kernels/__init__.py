from .attention import causal_attention, causal_attention_reference
from .paged_attention import kv_cache_write, paged_attention, paged_attention_reference
from .mla import mla_cache_write, mla_causal, mla_causal_reference, paged_mla, paged_mla_reference
from .conv1d import causal_conv1d, causal_conv1d_histories, causal_conv1d_reference, causal_conv1d_update
from .gated_delta import gated_delta_rule_chunked, gated_delta_rule_recurrent, gated_delta_rule_reference
from .moe import MoeSpec, moe, moe_reference, route, routed_experts, router_logits, router_margins
from .quantized_matmul import (QuantizedWeight, qat_linear, quantize, quantized_matmul,
                               quantized_matmul_reference)
