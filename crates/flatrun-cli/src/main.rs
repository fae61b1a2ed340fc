fn main() {
    println!("flatrun {}", env!("CARGO_PKG_VERSION"));
}
