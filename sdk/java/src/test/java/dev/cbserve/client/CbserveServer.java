package dev.cbserve.client;

import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthGrpc;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.Comparator;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;

/**
 * A real cbserve server for the tests: a tiny random Llama with a byte-level tokenizer (vocab 256)
 * made by {@code scripts/make_tiny_model.py}, served by {@code python3 -m service serve} on two
 * free loopback ports. One per test run ({@link CbserveServerExtension}); {@link #close()} stops it,
 * and a JVM shutdown hook does too if the run dies first. {@link #replica(Path, String)} starts
 * more servers of an existing model (for the load-balancing test).
 */
final class CbserveServer implements AutoCloseable {
  static final String ADMIN_TOKEN = "test-token";
  static final int VOCAB_SIZE = 256;

  private static final long MODEL_TIMEOUT_S = 180;
  private static final long HEALTH_TIMEOUT_S = 120;
  private static final int START_ATTEMPTS = 3;

  final String target;
  final String adminTarget;
  /** The folder of the served model: config, safetensors weights, tokenizer. */
  final Path modelDir;
  private final Process process;
  /** Removed on close: the folder of the model this server made, or null for a replica. */
  private final Path tempDir;
  private final Path log;
  private final Thread shutdownHook;

  private CbserveServer(
      Process process, String target, String adminTarget, Path modelDir, Path tempDir, Path log) {
    this.process = process;
    this.target = target;
    this.adminTarget = adminTarget;
    this.modelDir = modelDir;
    this.tempDir = tempDir;
    this.log = log;
    this.shutdownHook = new Thread(this::destroy, "cbserve-test-server-shutdown");
  }

  /** Makes the model, starts the server, waits for it to report SERVING. */
  static CbserveServer start() throws IOException, InterruptedException {
    Path repoRoot = repoRoot();
    Path logDir = Paths.get(System.getProperty("cbserve.test.dir", "target/cbserve-test"));
    Files.createDirectories(logDir);
    Path tempDir = Files.createTempDirectory("cbserve-java-test");
    try {
      Path model = tempDir.resolve("model");
      run(
          repoRoot,
          logDir.resolve("make_tiny_model.log"),
          MODEL_TIMEOUT_S,
          python(),
          "scripts/make_tiny_model.py",
          model.toString());
      return serve(model, tempDir, "server");
    } catch (IOException | InterruptedException | RuntimeException e) {
      deleteRecursively(tempDir);
      throw e;
    }
  }

  /**
   * Another server of {@code model} (made by {@link #start()}), logging to {@code name}.log; its
   * {@link #close()} leaves the model in place.
   */
  static CbserveServer replica(Path model, String name) throws IOException, InterruptedException {
    return serve(model, null, name);
  }

  /**
   * A replica of {@code model} on these ports (generation, admin), returned at once: its ports
   * open, and its health says NOT_SERVING, while its model loads; {@link #awaitServing()} waits.
   */
  static CbserveServer launch(Path model, String name, int[] ports) throws IOException {
    return launch(model, null, name, ports);
  }

  private static CbserveServer serve(Path model, Path tempDir, String name)
      throws IOException, InterruptedException {
    IOException last = null;
    for (int attempt = 1; attempt <= START_ATTEMPTS; attempt++) {
      CbserveServer server = launch(model, tempDir, name, freePorts());
      try {
        server.awaitServing();
        return server;
      } catch (IOException e) {
        last = e;
        server.close(false);
      }
    }
    throw last;
  }

  private static CbserveServer launch(Path model, Path tempDir, String name, int[] ports)
      throws IOException {
    Path logDir = Paths.get(System.getProperty("cbserve.test.dir", "target/cbserve-test"));
    Files.createDirectories(logDir);
    Path log = logDir.resolve(name + ".log");
    ProcessBuilder builder =
        new ProcessBuilder(
                python(), "-m", "service", "serve",
                "--model", model.toString(),
                "--host", "127.0.0.1",
                "--port", Integer.toString(ports[0]),
                "--admin-port", Integer.toString(ports[1]),
                "--num-blocks", "256",
                "--page-size", "16",
                "--grace-period", "1")
            .directory(repoRoot().toFile())
            .redirectErrorStream(true)
            .redirectOutput(log.toFile());
    builder.environment().put("CBSERVE_ADMIN_TOKEN", ADMIN_TOKEN);
    builder.environment().put("PYTHONUNBUFFERED", "1");
    Process process = builder.start();
    CbserveServer server =
        new CbserveServer(
            process, "127.0.0.1:" + ports[0], "127.0.0.1:" + ports[1], model, tempDir, log);
    Runtime.getRuntime().addShutdownHook(server.shutdownHook);
    return server;
  }

  /** Waits until the server reports SERVING on grpc.health.v1. */
  void awaitServing() throws IOException, InterruptedException {
    ManagedChannel channel = Grpc.newChannelBuilder(target, InsecureChannelCredentials.create()).build();
    try {
      HealthGrpc.HealthBlockingStub health = HealthGrpc.newBlockingStub(channel);
      long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(HEALTH_TIMEOUT_S);
      while (System.nanoTime() < deadline) {
        if (!process.isAlive()) {
          throw new IOException(
              "the server exited with " + process.exitValue() + " before serving:\n" + logTail());
        }
        try {
          HealthCheckResponse response =
              health
                  .withDeadlineAfter(1, TimeUnit.SECONDS)
                  .check(HealthCheckRequest.newBuilder().setService("").build());
          if (response.getStatus() == HealthCheckResponse.ServingStatus.SERVING) {
            return;
          }
        } catch (io.grpc.StatusRuntimeException e) {
          // not listening yet, or still loading
        }
        Thread.sleep(200);
      }
      throw new IOException(
          "the server did not report SERVING within " + HEALTH_TIMEOUT_S + " s:\n" + logTail());
    } finally {
      channel.shutdownNow();
      channel.awaitTermination(5, TimeUnit.SECONDS);
    }
  }

  /** Kills the server at once (SIGKILL, as a crash or a lost node would), keeping its files. */
  void kill() throws InterruptedException {
    List<ProcessHandle> children = process.descendants().toList();
    process.destroyForcibly();
    children.forEach(ProcessHandle::destroyForcibly);
    process.waitFor(10, TimeUnit.SECONDS);
  }

  /** Stops the server and removes the model (unless it is a replica's). */
  @Override
  public void close() {
    close(true);
  }

  private void close(boolean deleteTemp) {
    destroy();
    try {
      Runtime.getRuntime().removeShutdownHook(shutdownHook);
    } catch (IllegalStateException e) {
      // the JVM is shutting down: the hook runs (or ran) anyway
    }
    if (deleteTemp && tempDir != null) {
      deleteRecursively(tempDir);
    }
  }

  private void destroy() {
    List<ProcessHandle> children = process.descendants().toList();
    process.destroy();
    try {
      if (!process.waitFor(10, TimeUnit.SECONDS)) {
        process.destroyForcibly();
        process.waitFor(10, TimeUnit.SECONDS);
      }
    } catch (InterruptedException e) {
      process.destroyForcibly();
      Thread.currentThread().interrupt();
    }
    children.forEach(ProcessHandle::destroyForcibly);
  }

  String logTail() {
    try {
      List<String> lines = Files.readAllLines(log, StandardCharsets.UTF_8);
      return String.join("\n", lines.subList(Math.max(0, lines.size() - 40), lines.size()));
    } catch (IOException e) {
      return "(no log: " + e + ")";
    }
  }

  private static String python() {
    String python = System.getenv("CBSERVE_PYTHON");
    return python == null || python.isEmpty() ? "python3" : python;
  }

  private static Path repoRoot() {
    Path root = Paths.get(System.getProperty("cbserve.repo.root", "../..")).toAbsolutePath().normalize();
    if (!Files.isRegularFile(root.resolve("scripts/make_tiny_model.py"))) {
      throw new IllegalStateException("not the cbserve repository root: " + root);
    }
    return root;
  }

  private static void run(Path cwd, Path log, long timeoutS, String... command)
      throws IOException, InterruptedException {
    Process process =
        new ProcessBuilder(command)
            .directory(cwd.toFile())
            .redirectErrorStream(true)
            .redirectOutput(log.toFile())
            .start();
    if (!process.waitFor(timeoutS, TimeUnit.SECONDS)) {
      process.destroyForcibly();
      throw new IOException(String.join(" ", command) + " took over " + timeoutS + " s");
    }
    if (process.exitValue() != 0) {
      throw new IOException(
          String.join(" ", command) + " failed (" + process.exitValue() + "):\n"
              + Files.readString(log, StandardCharsets.UTF_8));
    }
  }

  /** Two distinct free loopback ports (free when asked; the server binds them right after). */
  /** Two free loopback ports. */
  static int[] freePorts() throws IOException {
    InetAddress loopback = InetAddress.getByName("127.0.0.1");
    try (ServerSocket a = new ServerSocket(0, 1, loopback);
        ServerSocket b = new ServerSocket(0, 1, loopback)) {
      return new int[] {a.getLocalPort(), b.getLocalPort()};
    }
  }

  private static void deleteRecursively(Path dir) {
    if (dir == null || !Files.exists(dir)) {
      return;
    }
    try (Stream<Path> paths = Files.walk(dir)) {
      paths.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
    } catch (IOException e) {
      throw new UncheckedIOException(e);
    }
  }
}
