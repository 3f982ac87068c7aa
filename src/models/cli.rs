//! `pipetrain model gpt2|squeezenet|mlp [options] -o model.onnx`: builds a model and
//! writes it. The binary wires [`ModelArgs`] in; the work is [`model_command`].

use std::path::{Path, PathBuf};

use super::{build, initializer_elements, Gpt2Config, MlpConfig, ModelSpec, SqueezeNetConfig};
use crate::graph::declared_type;
use crate::onnx::proto::{
    tensor_shape_proto::dimension::Value as DimValue, type_proto, ValueInfoProto,
};
use crate::onnx::save_model;
use crate::tensor::DType;
use crate::{Error, Result};

/// `pipetrain model ...`: which model to write.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// The model.
    #[command(subcommand)]
    pub command: ModelCommand,
}

/// One model kind with its options and the output file.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ModelCommand {
    /// GPT-2 language model: `tokens` int64 [batch, seq] -> `logits` [batch*seq, vocab].
    Gpt2 {
        /// The model's configuration.
        #[command(flatten)]
        config: Gpt2Config,
        /// The ONNX file to write (folders are created).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// SqueezeNet 1.1: `x` float32 [batch, channels, size, size] -> `logits` [batch, classes].
    Squeezenet {
        /// The model's configuration.
        #[command(flatten)]
        config: SqueezeNetConfig,
        /// The ONNX file to write (folders are created).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// MLP: `x` float32 [batch, inputs] -> `logits` [batch, classes].
    Mlp {
        /// The model's configuration.
        #[command(flatten)]
        config: MlpConfig,
        /// The ONNX file to write (folders are created).
        #[arg(short, long)]
        output: PathBuf,
    },
}

impl ModelCommand {
    /// The model's configuration and the output file.
    pub fn into_parts(self) -> (ModelSpec, PathBuf) {
        match self {
            ModelCommand::Gpt2 { config, output } => (ModelSpec::Gpt2(config), output),
            ModelCommand::Squeezenet { config, output } => (ModelSpec::Squeezenet(config), output),
            ModelCommand::Mlp { config, output } => (ModelSpec::Mlp(config), output),
        }
    }
}

/// Builds the model and writes it (atomically, creating folders); returns a one-line
/// summary: kind, parameters, input and output shapes, file.
///
/// # Errors
/// `Config` naming the command-line option (`--heads`) and the rule; `Io` when the file
/// cannot be written.
pub fn model_command(cmd: ModelCommand) -> Result<String> {
    let (spec, output) = cmd.into_parts();
    spec.validate(Path::new("<command line>"))
        .map_err(as_option_error)?;
    let model = build(&spec)?;
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    }
    save_model(&model, &output)?;
    let graph = model.graph.as_ref();
    let io = |vs: Option<&Vec<ValueInfoProto>>| -> String {
        let list: Vec<String> = vs.into_iter().flatten().map(describe).collect();
        list.join(", ")
    };
    Ok(format!(
        "{}: {} parameters, {} -> {}, written to {}",
        spec.kind(),
        initializer_elements(&model),
        io(graph.map(|g| &g.input)),
        io(graph.map(|g| &g.output)),
        output.display()
    ))
}

/// `Config` errors of a command line name the option (`--d-model`), not the TOML field.
fn as_option_error(e: Error) -> Error {
    match e {
        Error::Config { path, field, rule } => {
            let option = field.strip_prefix("model.").map_or_else(
                || "the model's options".to_string(),
                |f| format!("--{}", f.split('[').next().unwrap_or(f).replace('_', "-")),
            );
            Error::Config {
                path,
                field: option,
                rule,
            }
        }
        other => other,
    }
}

/// `name type [d0, d1, ...]`, symbolic dimensions by name.
fn describe(v: &ValueInfoProto) -> String {
    let dtype = declared_type(v)
        .and_then(|(code, _)| DType::from_onnx(code))
        .map_or("?".into(), |t| format!("{t:?}").to_lowercase());
    let dims: Vec<String> = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t
            .shape
            .iter()
            .flat_map(|s| &s.dim)
            .map(|d| match &d.value {
                Some(DimValue::DimValue(n)) => n.to_string(),
                Some(DimValue::DimParam(p)) => p.clone(),
                None => "?".into(),
            })
            .collect(),
        _ => Vec::new(),
    };
    format!("{} {dtype} [{}]", v.name, dims.join(", "))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        model: ModelCommand,
    }

    fn parse(args: &[&str]) -> ModelCommand {
        Cli::try_parse_from(std::iter::once("model").chain(args.iter().copied()))
            .unwrap()
            .model
    }

    #[test]
    fn options_overlay_the_defaults_and_the_file_is_written_with_its_folders() {
        Cli::command().debug_assert();
        let dir = std::env::temp_dir().join(format!("pipetrain-model-cli-{}", std::process::id()));
        let out = dir.join("a/b/gpt2.onnx");
        let cmd = parse(&[
            "gpt2",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--heads",
            "2",
            "-o",
            out.to_str().unwrap(),
        ]);
        let (spec, _) = cmd.clone().into_parts();
        let want = Gpt2Config {
            layers: 1,
            d_model: 32,
            heads: 2,
            ..Default::default()
        };
        assert_eq!(spec, ModelSpec::Gpt2(want.clone()));
        let summary = model_command(cmd).unwrap();
        let params = want.param_count().unwrap();
        assert!(
            summary.starts_with(&format!(
                "gpt2: {params} parameters, tokens i64 [batch, 32] -> logits f32 [batch*32, 64]"
            )),
            "{summary}"
        );
        let model = crate::onnx::load_model(&out).unwrap();
        assert_eq!(initializer_elements(&model), params);

        let cmd = parse(&[
            "mlp",
            "--hidden",
            "16,8",
            "--batch",
            "4",
            "-o",
            out.to_str().unwrap(),
        ]);
        let (spec, _) = cmd.into_parts();
        let want = MlpConfig {
            hidden: vec![16, 8],
            batch: Some(4),
            ..Default::default()
        };
        assert_eq!(spec, ModelSpec::Mlp(want));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_rule_names_the_option() {
        let field = |args: &[&str]| match model_command(parse(args)) {
            Err(Error::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field(&["gpt2", "--d-model", "30", "-o", "x.onnx"]),
            "--heads"
        );
        assert_eq!(
            field(&["squeezenet", "--image-size", "8", "-o", "x.onnx"]),
            "--image-size"
        );
        assert_eq!(
            field(&["mlp", "--hidden", "4,0", "-o", "x.onnx"]),
            "--hidden"
        );
        assert!(!Path::new("x.onnx").exists());
    }
}
