//! The operator binary (the controller lands next).
fn main() {
    eprintln!("moult-operator: the controller is not implemented yet");
    std::process::exit(2);
}
