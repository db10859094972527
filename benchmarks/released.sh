# The released K3's features at gpu2's size, as `--set` arguments (sourced by the GPU training scripts): q-LoRA 1024,
# the 64-wide unrotated slice, KDA's convolution and lower-bound gate and scaled read, AttnRes over blocks of 2
# layers, a dense first layer of K3's width ratio (4.75 d), RMSNorm eps 1e-5.
# shellcheck disable=SC2034 # used by the scripts that source this file
RELEASED="--set model.q_lora_rank=1024 --set model.mla_rope_dim=64 --set model.mla_rope=false \
 --set model.kda_conv_size=4 --set model.kda_gate_lower_bound=-5.0 --set model.kda_scaled_read=true \
 --set model.attn_res_block_size=2 --set model.first_dense_layers=1 --set model.dense_inner=19456 \
 --set model.norm_eps=1.0e-5"
