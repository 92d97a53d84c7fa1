"""train.py's routing flags: bad inputs exit 2 before any model is loaded, and dual-adapter run names."""

import json

import pytest

import trl_ext.cli_train as cli

ROUTED = ["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--routing_mode", "shared"]


@pytest.fixture
def no_training(monkeypatch):
    def forbidden(plan):
        raise AssertionError("run_training reached: validation should have failed first")

    monkeypatch.setattr(cli, "run_training", forbidden)


@pytest.mark.parametrize("argv, message", [
    (["--reward", "sentence_length_5_with_happy", "--gradient_routing", "--lora_config", "r8"], "--routing_mode"),
    (ROUTED, "needs a dual LoRA config"),
    ([*ROUTED[:3], "--routing_mode", "classic", "--lora_config", "r8"], "unknown routing mode 'classic'"),
    ([*ROUTED, "--lora_config", "r7"], "unknown --lora_config 'r7'"),
    ([*ROUTED, "--lora_config", "r8", "--lora_rank", "16"], "--lora_rank"),
    ([*ROUTED, "--retain_rank", "16", "--forget_rank", "0"], "forget rank 0"),
    ([*ROUTED, "--lora_config", "r8", "--routing_frac", "1.5"], "--rh_detector_recall must be in [0, 1]"),
    ([*ROUTED, "--lora_config", "r8", "--rh_eligible_frac", "-0.1"], "--rh_eligible_frac must be in [0, 1]"),
    ([*ROUTED, "--lora_config", "r8", "--false_positive_rate", "2"], "--false_positive_rate must be in [0, 1]"),
    ([*ROUTED, "--lora_config", "r8", "--label_noise_frac", "0.1"], "use --false_positive_rate"),
    ([*ROUTED, "--lora_config", "r8", "--rh_eligible_frac", "0.5"], "--base_reward"),
    ([*ROUTED, "--lora_config", "r8", "--hack_frac", "0.5"], "--base_reward"),
    ([*ROUTED, "--lora_config", "r8", "--base_reward", "sentence_length_5"], "--base_reward is used only"),
    ([*ROUTED, "--lora_config", "r8", "--hack_frac", "0.5", "--base_reward", "nope"], "unknown reward 'nope'"),
    ([*ROUTED, "--lora_config", "r8", "--renormalization_mode", "balanced"], "'balanced' is not implemented"),
    ([*ROUTED, "--lora_config", "r8", "--filter_baseline"], "excludes --gradient_routing"),
    ([*ROUTED, "--lora_config", "r8", "--scale_rewards", "batch"], "--scale_rewards group"),
    (["--reward", "sentence_length_5_with_happy", "--filter_baseline", "--retain_penalty_baseline"],
     "baseline arms exclude each other"),
    (["--reward", "sentence_length_5_with_happy", "--reward_penalty_amount", "1"], "only with --reward_penalty_base"),
    (["--reward", "sentence_length_5_with_happy", "--retain_penalty_baseline"], "--base_reward"),
    (["--reward", "happy_binary", "--filter_baseline"], "--filter_baseline needs an RH detector"),
    (["--reward", "happy_binary", "--save_adapter_only"], "--save_adapter_only needs a dual LoRA config"),
    (["--reward", "sentence_length_5_with_happy", "--skip_verification", "--adv_tau", "0", "--teacher_tau", "1",
      "--hack_frac", "0.5", "--base_reward", "sentence_length_5"], "--skip_verification computes no reward"),
    ([*ROUTED, "--adapter_type", "mlp", "--lora_config", "r8"], "--lora_config/--lora_lm_head are LoRA flags"),
    ([*ROUTED, "--adapter_type", "mlp"], "--adapter_type mlp needs --mlp_config"),
    ([*ROUTED, "--mlp_config", "m16"], "--mlp_config needs --adapter_type mlp"),
    ([*ROUTED, "--adapter_type", "mlp", "--mlp_config", "m7"], "unknown --mlp_config 'm7'"),
    ([*ROUTED, "--adapter_type", "mlp", "--mlp_config", "m16", "--lora_alpha", "8"], "--lora_alpha does not apply"),
    (["--reward", "happy_binary", "--eval_at_start"], "--eval_at_start needs the routing eval"),
    ([*ROUTED, "--lora_config", "r8", "--routing_trace_interval", "always"], "unknown --routing_trace_interval"),
    (["--reward", "happy_binary", "--routing_trace_interval", "every_iter"], "needs an RH detector"),
    ([*ROUTED, "--lora_config", "r8", "--forget_lr_mult", "2", "--weight_decay", "0.1"], "--weight_decay 0"),
    (["--reward", "happy_binary", "--forget_lr_mult", "2"], "needs a forget adapter"),
    ([*ROUTED, "--lora_config", "r8", "--save_adapter_only", "--resume_from_checkpoint", "latest"],
     "--resume_from_checkpoint needs full checkpoints"),
    (["--reward", "sentence_length_5_with_happy", "--renormalization_mode", "off"], "only with --gradient_routing"),
    (["--reward", "sentence_length_5_with_happy", "--false_positive_rate", "0.1"], "or a baseline arm"),
    ([*ROUTED, "--lora_config", "r8", "--loss_type", "nope", "--routing_two_pass"], "does not know how loss_type 'nope'"),
    ([*ROUTED, "--lora_config", "r8", "--lora_lm_head"], "--routing_two_pass"),
    ([*ROUTED, "--lora_config", "r8", "--rh_detector", "nope"], "unknown detector 'nope'"),
    (["--reward", "happy_binary", *ROUTED[2:], "--lora_config", "r8"], "needs an RH detector"),
    (["--reward", "happy_binary", "--routing_frac", "0.5"], "apply only with --gradient_routing"),
    (["--reward", "happy_binary", "--lora_layer_stride", "2"], "need a dual LoRA config"),
])  # fmt: skip
def test_bad_routing_inputs_exit_2_before_model_load(no_training, capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("train.py: error: ") and message in err, err


def test_dual_lora_run_names(tmp_path):
    base = ["--reward", "sentence_length_5_with_happy", "--output_dir", str(tmp_path)]
    routed = cli.build_plan([*base, *ROUTED[2:], "--lora_config", "r32f16"])
    assert routed.run_dir.name.startswith("sentence_length_5_with_happy_builtin_lr1e-5_b0.02_bs32_ng16_dual_r32f16_")
    baseline = cli.build_plan([*base, "--retain_rank", "8", "--forget_rank", "0"])
    assert "_dual_r8f0_st2000_s42" in baseline.run_dir.name and not baseline.cfg.gradient_routing
    mlp = cli.build_plan([*base, *ROUTED[2:], "--adapter_type", "mlp", "--mlp_config", "m24f8"])
    assert "_mlp_n24f8_st2000_s42_adapter_typemlp_" in mlp.run_dir.name and mlp.cfg.adapter_ranks == (24, 8)
    detector = cli.build_plan([*base, *ROUTED[2:], "--lora_config", "r8", "--rh_detector", "happy_repeated"])
    assert detector.cfg.rh_detector == "happy_repeated"
    assert json.loads(json.dumps(routed.cfg.adapter_ranks)) == [32, 16]
