//! Every configuration rule: a bad value is refused up front with the file, the field and
//! the rule in the message.

use std::path::Path;

use pipetrain::config::TrainConfig;

const GOOD: &str = r#"
model_path = "../peers/data/mlp.onnx"
batch_size = 16
gradient_accumulation_steps = 4
num_train_steps = 40
pipeline_parallel_size = 2
data_parallel_size = 1
[loss]
kind = "softmax_cross_entropy"
prediction = "logits"
label = "y"
[data]
path = "../peers/data/mlp_data.npz"
batch_order = "batch_idx"
layout = { kind = "arrays", feeds = { x = "x", y = "y" } }
[optimizer]
kind = "adamw"
[lr_schedule]
kind = "linear"
lr = 1e-3
warmup_ratio = 0.1
[pipeline]
schedule = "1f1b"
"#;

fn path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/rules.toml")
}

fn refused(text: &str, field: &str, rule: &str) {
    let err = TrainConfig::parse(text, &path())
        .expect_err(&format!("must refuse: {field}"))
        .to_string();
    assert!(err.contains("rules.toml"), "names the file: {err}");
    assert!(
        err.contains(&format!("`{field}`")),
        "names `{field}`: {err}"
    );
    assert!(err.contains(rule), "says `{rule}`: {err}");
}

fn with(old: &str, new: &str) -> String {
    assert!(GOOD.contains(old), "{old}");
    GOOD.replacen(old, new, 1)
}

#[test]
fn the_good_config_is_accepted_and_derived_values_follow_ort() {
    let c = TrainConfig::parse(GOOD, &path()).unwrap();
    assert_eq!(c.optimizer_steps(), 10);
    assert_eq!(c.global_batch(), 64);
    assert_eq!(c.stages(), 2);
}

#[test]
fn parallel_sizes() {
    refused(
        &with(
            "data_parallel_size = 1",
            "data_parallel_size = 1\nworld_size = 4",
        ),
        "world_size",
        "must equal data_parallel_size x horizontal_parallel_size x pipeline_parallel_size = 2",
    );
    refused(
        &with(
            "data_parallel_size = 1",
            "data_parallel_size = 1\nhorizontal_parallel_size = 2\nworld_size = 2",
        ),
        "world_size",
        "must equal data_parallel_size x horizontal_parallel_size x pipeline_parallel_size = 4",
    );
    refused(
        &with("pipeline_parallel_size = 2", "pipeline_parallel_size = 0"),
        "pipeline_parallel_size",
        "at least 1",
    );
    refused(
        &with("data_parallel_size = 1", "data_parallel_size = 0"),
        "data_parallel_size",
        "at least 1",
    );
}

#[test]
fn steps_and_micro_batches() {
    refused(
        &with("num_train_steps = 40", "num_train_steps = 42"),
        "num_train_steps",
        "divisible by gradient_accumulation_steps (4)",
    );
    refused(
        &with("num_train_steps = 40", "num_train_steps = 0"),
        "num_train_steps",
        "at least 1",
    );
    refused(
        &with(
            "gradient_accumulation_steps = 4",
            "gradient_accumulation_steps = 1",
        )
        .replace("num_train_steps = 40", "num_train_steps = 10"),
        "gradient_accumulation_steps",
        "needs at least as many micro-batches as pipeline stages (2), got 1",
    );
    refused(
        &with("batch_size = 16", "batch_size = 0"),
        "batch_size",
        "at least 1",
    );
}

#[test]
fn schedule_and_partition() {
    refused(
        &with(
            "schedule = \"1f1b\"",
            "schedule = \"1f1b\"\nvirtual_stages = 2",
        ),
        "pipeline.virtual_stages",
        "only the interleaved_1f1b schedule",
    );
    refused(
        &with(
            "schedule = \"1f1b\"",
            "schedule = \"interleaved_1f1b\"\nvirtual_stages = 2",
        )
        .replace(
            "gradient_accumulation_steps = 4",
            "gradient_accumulation_steps = 5",
        )
        .replace("num_train_steps = 40", "num_train_steps = 50"),
        "pipeline.schedule",
        "multiple",
    );
    refused(
        &with(
            "schedule = \"1f1b\"",
            "schedule = \"1f1b\"\npartition = { cut_at = [\"a\", \"b\"] }",
        ),
        "pipeline.partition.cut_at",
        "2 cuts make 3 stages; the pipeline has 2",
    );
    refused(
        &with(
            "schedule = \"1f1b\"",
            "schedule = \"1f1b\"\npartition = { balanced = { stages = 3, by = \"params\" } }",
        ),
        "pipeline.partition.balanced.stages",
        "must equal pipeline_parallel_size x virtual_stages = 2",
    );
    refused(
        &with("schedule = \"1f1b\"", "schedule = \"2f2b\""),
        "pipeline.schedule",
        "unknown variant `2f2b`",
    );
}

#[test]
fn optimizer_and_learning_rate() {
    refused(
        &with("kind = \"adamw\"", "kind = \"adagrad\""),
        "optimizer.kind",
        "unknown variant `adagrad`",
    );
    refused(
        &with("kind = \"adamw\"", "kind = \"adamw\"\nbeta1 = 1.5"),
        "optimizer.beta1",
        "[0, 1)",
    );
    refused(
        &with("kind = \"adamw\"", "kind = \"sgd\"\nnesterov = true"),
        "optimizer.nesterov",
        "momentum",
    );
    refused(&with("lr = 1e-3", "lr = -1e-3"), "lr_schedule.lr", "");
    refused(
        &with("warmup_ratio = 0.1", "warmup_ratio = 1.5"),
        "lr_schedule.warmup_ratio",
        "",
    );
}

#[test]
fn unknown_keys_and_other_values() {
    refused(
        &with("batch_size = 16", "batch_size = 16\nlearning_rate = 0.1"),
        "learning_rate",
        "unknown field `learning_rate`",
    );
    refused(
        &with("kind = \"adamw\"", "kind = \"adamw\"\nmomentum = 0.9"),
        "optimizer.momentum",
        "unknown field `momentum`",
    );
    refused(
        &with("batch_size = 16", "batch_size = 16\nwatchdog_seconds = 0"),
        "watchdog_seconds",
        "positive",
    );
    refused(
        &with(
            "num_train_steps = 40",
            "num_train_steps = 40\ndisplay_loss_steps = 0",
        ),
        "display_loss_steps",
        "at least 1",
    );
}

#[test]
fn a_global_batch_that_does_not_fit_the_data_is_refused_before_training() {
    // 16 x 4 x 1 = 64 rows a step fit batch_idx; 12 x 4 = 48 do not.
    let cfg = TrainConfig::parse(&with("batch_size = 16", "batch_size = 12"), &path()).unwrap();
    let rt = pipetrain::compute::Runtime::from_env().unwrap();
    let err = pipetrain::train::train(&rt, &cfg, &path(), false, |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rules.toml")
            && err.contains("`batch_size`")
            && err.contains("= 48 must equal the 64 rows per step"),
        "{err}"
    );
}

/// An elastic job's smaller run: fewer replicas accumulate more micro-batches, with the
/// same global batch, optimizer steps and evaluation set; a count that does not share a
/// step's micro-batches is refused.
#[test]
fn the_same_run_at_fewer_replicas() {
    let dp4 = with(
        "data_parallel_size = 1",
        "data_parallel_size = 4\neval_micro_batches = 3",
    );
    let c = TrainConfig::parse(&dp4, &path()).unwrap();
    let two = c.at_data_parallel(2, &path()).unwrap();
    assert_eq!(
        (two.data_parallel_size, two.gradient_accumulation_steps),
        (2, 8)
    );
    assert_eq!(two.global_batch(), c.global_batch());
    assert_eq!(two.optimizer_steps(), c.optimizer_steps());
    assert_eq!(two.eval_micro_batches, 6);
    let err = c.at_data_parallel(3, &path()).unwrap_err().to_string();
    assert!(
        err.contains("data_parallel_size") && err.contains("16 micro-batches"),
        "{err}"
    );
}

/// `[[optimizer_attributes]]`: each group's values follow the optimizer's rules, named
/// by the group's index; moments only for optimizers that keep them.
#[test]
fn optimizer_attributes_rules() {
    let group = |body: &str| format!("{GOOD}\n[[optimizer_attributes]]\n{body}\n");
    TrainConfig::parse(&group("params = [\"*.bias\"]\nweight_decay = 0.0"), &path()).unwrap();
    refused(
        &group("params = [\"*.bias\"]\nbeta1 = 1.5"),
        "optimizer_attributes[0].beta1",
        "[0, 1)",
    );
    refused(
        &group("params = []"),
        "optimizer_attributes[0].params",
        "at least one",
    );
    refused(
        &group("params = [\"[a\"]"),
        "optimizer_attributes[0].params",
        "`[a`",
    );
    refused(
        &group("params = [\"*\"]\nlr_scale = -1.0"),
        "optimizer_attributes[0].lr_scale",
        ">= 0",
    );
    let sgd = with("kind = \"adamw\"", "kind = \"sgd\"");
    refused(
        &format!("{sgd}\n[[optimizer_attributes]]\nparams = [\"*\"]\neps = 1e-6\n"),
        "optimizer_attributes[0].eps",
        "not sgd",
    );
}

/// Adasum pairs replicas in a binary tree: a replica count that is not a power of two
/// is refused, naming the key.
#[test]
fn adasum_needs_a_power_of_two_of_replicas() {
    let at = |dp: usize| {
        with(
            "data_parallel_size = 1",
            &format!("data_parallel_size = {dp}\nenable_adasum = true"),
        )
    };
    TrainConfig::parse(&at(4), &path()).unwrap();
    refused(&at(3), "enable_adasum", "must be a power of two, got 3");
}

/// ZeRO: stages 0 to 2; stage 2 reduces its gradient buckets on the host, one tensor
/// shard per replica, with Adasum off: each rule refused naming its key.
#[test]
fn zero_stage_2_needs_buckets_on_the_host_and_stage_3_is_refused() {
    let at = |extra: &str| {
        with(
            "data_parallel_size = 1",
            &format!("data_parallel_size = 2\n{extra}"),
        )
    };
    TrainConfig::parse(&at("deepspeed_zero_stage = 2"), &path()).unwrap();
    refused(
        &at("deepspeed_zero_stage = 3"),
        "deepspeed_zero_stage",
        "stage 3 (sharded parameters) is not built, got 3",
    );
    refused(
        &at("deepspeed_zero_stage = 2\ngradient_bucket_mb = 0"),
        "gradient_bucket_mb",
        "must be more than 0",
    );
    refused(
        &at("deepspeed_zero_stage = 2\nenable_adasum = true"),
        "deepspeed_zero_stage",
        "use one or the other",
    );
}

#[test]
fn bfloat16_needs_mixed_precision_and_a_gpu() {
    refused(
        &with("batch_size = 16", "batch_size = 16\nuse_bfloat16 = true"),
        "use_bfloat16",
        "needs `use_mixed_precision = true`",
    );
    refused(
        &with(
            "batch_size = 16",
            "batch_size = 16\nuse_mixed_precision = true\nuse_bfloat16 = true",
        ),
        "use_bfloat16",
        "no bfloat16 matrix product",
    );
    let f16 = with(
        "batch_size = 16",
        "batch_size = 16\nuse_mixed_precision = true",
    );
    let c = TrainConfig::parse(&f16, &path()).unwrap();
    assert_eq!(c.half(), Some(pipetrain::graph::autocast::Half::F16));
}

#[test]
fn float16_mixed_precision_scales_the_loss_dynamically_unless_told() {
    let parse = |extra: &str| {
        let text = with("batch_size = 16", &format!("batch_size = 16\n{extra}"));
        TrainConfig::parse(&text, &path()).unwrap().loss_scale()
    };
    assert_eq!(parse(""), 1.0);
    assert_eq!(parse("use_mixed_precision = true"), 0.0);
    assert_eq!(parse("use_mixed_precision = true\nloss_scale = 128"), 128.0);
    refused(
        &with("batch_size = 16", "batch_size = 16\nloss_scale = -1"),
        "loss_scale",
        "positive factor",
    );
}
