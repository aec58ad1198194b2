package dev.cbserve.client;

import io.grpc.ChannelCredentials;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.TlsChannelCredentials;
import io.grpc.stub.MetadataUtils;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Objects;

/** What both clients' builders collect: where to connect, how, and the default deadline. */
final class ChannelOptions implements Cloneable {
  static final String USER_AGENT = "cbserve-java/0.1.0";
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

  String target;
  String token;
  ChannelCredentials credentials;
  TlsFiles tlsFiles;
  String authority;
  Duration defaultTimeout = Calls.DEFAULT_TIMEOUT;
  ManagedChannel channel;

  /** PEM files of a TLS configuration, read when the channel is built. */
  record TlsFiles(Path caCertificate, Path certificateChain, Path privateKey) {}

  void defaultTimeout(Duration timeout) {
    this.defaultTimeout = timeout == null ? null : Calls.checkTimeout(timeout);
  }

  void tls(Path caCertificate, Path certificateChain, Path privateKey) {
    if ((certificateChain == null) != (privateKey == null)) {
      throw new IllegalArgumentException("give both the client certificate chain and its key");
    }
    this.tlsFiles = new TlsFiles(caCertificate, certificateChain, privateKey);
    this.credentials = null;
  }

  void credentials(ChannelCredentials credentials) {
    this.credentials = Objects.requireNonNull(credentials, "credentials");
    this.tlsFiles = null;
  }

  ChannelOptions copy() {
    try {
      return (ChannelOptions) super.clone();
    } catch (CloneNotSupportedException e) {
      throw new AssertionError(e);
    }
  }

  /** True when the channel is given (not built, not owned). */
  boolean external() {
    return channel != null;
  }

  /** The channel to use: the given one, or a new one to {@link #target}. */
  ManagedChannel build() {
    if (channel != null) {
      return channel;
    }
    if (target == null || target.isEmpty()) {
      throw new IllegalStateException("target is required (e.g. \"127.0.0.1:50051\")");
    }
    ManagedChannelBuilder<?> builder = Grpc.newChannelBuilder(target, channelCredentials());
    builder.userAgent(USER_AGENT);
    if (authority != null) {
      builder.overrideAuthority(authority);
    }
    if (token != null && !token.isEmpty()) {
      Metadata headers = new Metadata();
      headers.put(AUTHORIZATION, "Bearer " + token);
      builder.intercept(MetadataUtils.newAttachHeadersInterceptor(headers));
    }
    return builder.build();
  }

  private ChannelCredentials channelCredentials() {
    if (credentials != null) {
      return credentials;
    }
    if (tlsFiles == null) {
      return InsecureChannelCredentials.create();
    }
    TlsChannelCredentials.Builder tls = TlsChannelCredentials.newBuilder();
    try {
      if (tlsFiles.caCertificate() != null) {
        tls.trustManager(tlsFiles.caCertificate().toFile());
      }
      if (tlsFiles.certificateChain() != null) {
        tls.keyManager(tlsFiles.certificateChain().toFile(), tlsFiles.privateKey().toFile());
      }
    } catch (IOException e) {
      throw new UncheckedIOException("cannot read the TLS files " + tlsFiles, e);
    }
    return tls.build();
  }
}
