fn main() {
    println!("ringllm {}", env!("CARGO_PKG_VERSION"));
}
